"""Data: the small datasets held in memory (`datasets`, `raw_files`);
folders and TFDS datasets (`file_sources`: `image_folder`, `tfds_source`),
streamed through grain workers (`streaming`, with the per-example work in
`examples` and `image_decode`); the training order (`order`); batches on
the mesh (`input_pipeline`); on-device augmentation (`augment`,
`randaugment`, `mixing`); `export_folder` writes a dataset out as a
folder."""
