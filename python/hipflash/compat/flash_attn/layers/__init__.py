"""flash_attn.layers: the rotary embedding's function (flash_attn.layers.rotary)."""
