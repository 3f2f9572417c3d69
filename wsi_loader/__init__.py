"""wsi_loader."""
