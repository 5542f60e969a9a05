"""``sess.fork()`` lives with the Session, in ``qwen_npu.session.fork``; importing this module
still works, with a DeprecationWarning."""
from ..errors import warn
from ..session.fork import (Branches, fork_session, reset_branch,  # noqa: F401
                            sibling_holders, visible_requests)

warn("qwen_npu.research.fork moved to qwen_npu.session.fork", DeprecationWarning)
