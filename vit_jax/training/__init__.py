"""Training: the pure, jit-compiled steps (`steps`), the loop around them
(`loop.train_and_evaluate`), the optimizer and schedules (`optim`), the
wall-time budget (`budget`) and the metric log (`metric_writer`)."""
