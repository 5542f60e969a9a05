"""``sess.fork()`` lives with the Session, in ``qwen_npu.session_fork``; this name stays for
code that imported it from here."""
from ..session_fork import (  # noqa: F401
                            Branches,
                            close_branch,
                            fork_session,
                            reset_branch,
                            sibling_holders,
                            visible_requests,
)
