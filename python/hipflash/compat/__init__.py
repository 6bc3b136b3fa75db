"""Drop-in modules for code written against FlashAttention:

    import hipflash.compat.flash_attn as flash_attn                      # FlashAttention 2
    from hipflash.compat.flash_attn_interface import flash_attn_func     # FlashAttention 3
    import hipflash.compat.ring_flash_attn as ring_flash_attn            # ring-flash-attn

The same function names, argument names, defaults and return conventions, run by hipflash. An
argument hipflash cannot honour yet (dropout, qv, a value head dim of its own, ...) raises
NotImplementedError naming it, never a silently different result; the list is in
docs/compat.md.
"""
from . import flash_attn, flash_attn_interface  # noqa: F401
