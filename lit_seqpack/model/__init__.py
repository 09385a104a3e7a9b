"""Model layer: varlen attention backends, the LightningModule mixin, the loss, model adapters."""
