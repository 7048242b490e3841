"""Loading the MTP: original DeepSeek-V4 releases (native names, FP8/FP4 formats), our own
standalone checkpoints, and the Hub remote-code files written beside them."""

from .native import MtpCheckpointError, is_native_checkpoint, load_native_mtp
from .remote_code import AUTO_MAP, save_with_remote_code, write_remote_code

__all__ = [
    "AUTO_MAP",
    "MtpCheckpointError",
    "is_native_checkpoint",
    "load_native_mtp",
    "save_with_remote_code",
    "write_remote_code",
]
