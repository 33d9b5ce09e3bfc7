"""zerokl: RL post-training and serving with train/inference KL exactly 0."""
