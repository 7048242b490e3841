"""Loading the MTP: original DeepSeek-V4 releases (native names, FP8/FP4 formats), our own
standalone checkpoints, and the Hub remote-code files written beside them; exporting a drafter in the
release layout for serving engines (:mod:`.export`)."""

from .checkpoint import checkpoint_kind, load_saved_draft
from .export import save_release_layout
from .files import is_native_checkpoint
from .formats import MtpCheckpointError
from .native import load_native_mtp
from .remote_code import AUTO_MAP, save_with_remote_code, write_remote_code
from .save_guard import SaveDirectoryError

__all__ = [
    "AUTO_MAP",
    "MtpCheckpointError",
    "SaveDirectoryError",
    "checkpoint_kind",
    "is_native_checkpoint",
    "load_native_mtp",
    "load_saved_draft",
    "save_release_layout",
    "save_with_remote_code",
    "write_remote_code",
]
