"""The model: the paper's ViT (`vit`) and its named variants (`variants`)."""
