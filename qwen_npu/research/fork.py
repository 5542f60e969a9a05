"""``sess.fork()`` lives with the Session, in ``qwen_npu.session_fork``; importing this module
still works, with a DeprecationWarning."""
import warnings

from ..session_fork import (Branches, close_branch, fork_session, reset_branch,  # noqa: F401
                            sibling_holders, visible_requests)

warnings.warn("qwen_npu.research.fork moved to qwen_npu.session_fork", DeprecationWarning, stacklevel=2)
