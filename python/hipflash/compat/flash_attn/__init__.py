"""FlashAttention 2's package (``flash_attn``): its functions, from flash_attn_interface as
upstream's package exports them, run by hipflash (see flash_attn_interface's docstring)."""
from . import bert_padding  # noqa: F401  (flash_attn.bert_padding)
from .flash_attn_interface import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

# The flash-attn release whose Python API these functions follow (names, arguments, defaults,
# return conventions), for code that checks it.
__version__ = "2.8.3"

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
