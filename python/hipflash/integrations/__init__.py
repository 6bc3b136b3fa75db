"""hipflash inside frameworks: ``hipflash.integrations.transformers`` (Hugging Face)."""
