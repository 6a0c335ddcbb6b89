"""PDM training: self-distillation data, teacher features, the structured mask and the trainer."""
