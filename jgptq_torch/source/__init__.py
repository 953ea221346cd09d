"""Where a model's weights come from: checkpoint folders read layer by layer."""
