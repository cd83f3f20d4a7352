"""Data: datasets and their sources (`datasets`, `raw_files`), batches on
the mesh (`input_pipeline`), on-device augmentation (`augment`,
`randaugment`, `mixing`)."""
