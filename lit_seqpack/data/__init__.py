"""Data layer: samplers (a rank's view of the plan), collation into the batch contract, the DataModule."""
