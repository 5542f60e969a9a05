"""A simulated Ctrl-C at any executed line of the package, and the checks after it.

``CtrlC(k)`` is a ``sys.settrace`` function: the k-th 'line' event in a frame whose file lies in
the package (``qwen_npu/`` or ``kernels/``, installed as ``qwen_npu.kernels``) does what the OS
delivering SIGINT would make Python do there: with ``signal.default_int_handler`` in force it
raises ``KeyboardInterrupt``; with another Python handler (the library holding Ctrl-C back) it
calls ``handler(SIGINT, frame)`` and the code goes on; with SIG_IGN nothing happens. It fires
once. ``sweep`` runs a program uninterrupted (twice, on two fresh sessions: their digests must be
equal for the comparison to mean anything), then once per trial k on a fresh session, with the
Ctrl-C in one call, and checks: the digest equals the one before or the one after the call (for
``generate``, after any of its own steps), ``check()`` passes, another thread can enter the call
gate, SIGINT is handled as before, and completing the program gives the same finished tokens and
final digest. It returns every problem found, one line each naming the program, the call, k and
the file:line where the Ctrl-C landed.
"""
from __future__ import annotations

import gc
import os
import signal
import sys
import threading
from dataclasses import dataclass, field

import pytest
import torch

import qwen_npu
from qwen_npu import Session, kernels
from qwen_npu.errors import InvalidRequestError, SessionBusyError

ROOTS = tuple(os.path.dirname(m.__file__) + os.sep for m in (qwen_npu, kernels))


def stride(default: int) -> int:
    """Trials every ``QWEN_NPU_SWEEP_STRIDE`` lines (1: every line), else every ``default``."""
    return max(1, int(os.environ.get("QWEN_NPU_SWEEP_STRIDE") or default))


def where(frame) -> str:
    path = frame.f_code.co_filename
    for root in ROOTS:
        if path.startswith(root):
            path = os.path.basename(root.rstrip(os.sep)) + "/" + path[len(root):]
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


class CtrlC:
    """Trace function firing a simulated Ctrl-C at the k-th package line (see the module doc)."""

    def __init__(self, k: int):
        self.k, self.seen, self.fired, self.how = k, 0, None, None

    def __call__(self, frame, event, arg):
        if self.fired is None and frame.f_code.co_filename.startswith(ROOTS):
            return self.line
        return None

    def line(self, frame, event, arg):
        if event != "line" or self.fired is not None:
            return self.line if self.fired is None else None
        if self.seen < self.k:
            self.seen += 1
            return self.line
        self.fired = where(frame)
        sys.settrace(None)                       # once: the rest of the call runs untraced
        handler = signal.getsignal(signal.SIGINT)
        if handler is signal.default_int_handler:
            self.how = "raised"
            raise KeyboardInterrupt(f"simulated Ctrl-C at {self.fired}")
        if callable(handler):
            self.how = "held back"
            handler(signal.SIGINT, frame)
        else:
            self.how = "ignored"
        return None


class World:
    """The sessions a program works on: ``sess``, and ``child`` once it forks."""

    def __init__(self, ckpt, kw):
        self.sess = Session.from_pretrained(ckpt, **kw)
        self.child = None

    def sessions(self):
        return [(n, s) for n, s in (("sess", self.sess), ("child", self.child)) if s is not None]

    def digest(self):
        out = []
        for name, s in self.sessions():
            try:
                out.append((name, "closed" if s.closed else s.state_digest(kv=True)))
            except Exception as e:  # noqa: BLE001 (a half-closed session may have none)
                out.append((name, f"no digest: {type(e).__name__}: {e}"))
        return tuple(out)

    def tokens(self):
        return {n: [(r.id, r.status, tuple(r.output_token_ids)) for r in s.requests]
                for n, s in self.sessions()}


@dataclass
class Call:
    """One call of a program. ``steps``: for a call made of several transactions (``generate``),
    the same calls one by one; the state after each is an accepted outcome."""
    label: str
    fn: object
    steps: list = field(default_factory=list)


def add(prompt, sampling) -> Call:
    """``add_request(prompt, sampling)`` as a call of a program."""
    return Call("add_request", lambda w: w.sess.add_request(prompt, sampling))


def generate_call(prompts, samplings, steps: int) -> Call:
    """``generate(prompts, samplings)`` as a call of a program. Its transactions one by one: each
    ``add_request``, then up to ``steps`` steps (a step once every request is done is skipped)."""
    def gen(w):
        w.sess.generate(prompts, samplings, progress=False)

    def add_each(i):
        return lambda w: w.sess.add_request(prompts[i], samplings[i])

    def step_if_running(w):
        if any(not r.is_done for r in w.sess.requests):
            w.sess.step()
    adds = [add_each(i) for i in range(len(prompts))]
    return Call("generate()", gen, steps=adds + [step_if_running] * steps)


def diff(a, b) -> str:
    da, db = dict(a), dict(b)
    parts = []
    for name in sorted(set(da) | set(db)):
        x, y = da.get(name, "not held by the program"), db.get(name, "not held by the program")
        if x != y:
            detail = x.diff(y) if hasattr(x, "diff") and hasattr(y, "diff") else f"{_short(x)} vs {_short(y)}"
            parts.append(f"{name}: {detail}")
    return "; ".join(parts)


def _short(d) -> str:
    return repr(d)[:80]


def reference(ckpt, kw, calls):
    """Run uninterrupted; returns per call the accepted (digest, calls to finish it) and the end."""
    w = World(ckpt, kw)
    accepted = []
    for j, call in enumerate(calls):
        before = w.digest()
        call.fn(w)
        options = [(before, [call.fn]), (w.digest(), [])]
        if call.steps:                                 # replay its transactions on a twin
            t = World(ckpt, kw)
            for c in calls[:j]:
                c.fn(t)
            options = [(before, [call.fn])]
            for i, fn in enumerate(call.steps):
                fn(t)
                options.append((t.digest(), call.steps[i + 1:]))
            assert options[-1][0] == w.digest(), f"{call.label}: its steps one by one end elsewhere"
        accepted.append(options)
    return accepted, w.tokens(), w.digest()


def gate_problem(w) -> str | None:
    """Another thread enters the call gate (a gated call that changes nothing) or is refused."""
    open_ = [s for _, s in w.sessions() if not s.closed]
    if not open_:
        return None
    out = []

    def run():
        try:
            open_[0].abort(10**9)
        except SessionBusyError as e:
            out.append(f"call gate still held: {e}")
        except InvalidRequestError:
            pass
        except BaseException as e:  # noqa: BLE001 (any failure is a finding)
            out.append(f"another thread's call raised {type(e).__name__}: {e}")
    t = threading.Thread(target=run, name="sweep-probe")
    t.start()
    t.join(30)
    return out[0] if out else ("another thread's call hangs" if t.is_alive() else None)


def trial(ckpt, kw, calls, j, k, accepted, want_tokens, want_digest, after=None):
    """One trial; returns (fired, problems). ``after(w, took_effect)``, where given, continues
    the program instead of the remaining calls and returns the problems it finds."""
    w = World(ckpt, kw)
    for c in calls[:j]:
        c.fn(w)
    ctl = CtrlC(k)
    raised = None
    sys.settrace(ctl)
    try:
        calls[j].fn(w)
    except KeyboardInterrupt:
        pass
    except Exception as e:  # noqa: BLE001 (any failure is a finding)
        raised = f"the call raised {type(e).__name__}: {e}"
    finally:
        sys.settrace(None)
    if ctl.fired is None:
        return False, []
    problems = [raised] if raised else []
    handler = signal.getsignal(signal.SIGINT)
    if handler is not signal.default_int_handler:
        problems.append(f"SIGINT handler left replaced by {handler!r}")
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not torch.is_grad_enabled():
        problems.append("autograd left disabled (a no_grad region was left without its exit)")
        torch.set_grad_enabled(True)
    gc.collect()                                 # a fork whose result was lost is dropped now
    now = w.digest()
    match = next((i for i, (d, _) in enumerate(accepted[j]) if d == now), None)
    if match is None:
        problems.append(f"digest matches neither before nor after the call (vs before: "
                        f"{diff(accepted[j][0][0], now)} | vs after: {diff(accepted[j][-1][0], now)})")
    for name, s in w.sessions():
        if not s.closed:
            try:
                report = s.check()
                if not report.ok:
                    problems.append(f"{name}.check() fails: {str(report)[:300]}")
            except Exception as e:  # noqa: BLE001 (any failure is a finding)
                problems.append(f"{name}.check() raised {type(e).__name__}: {e}")
    gate = gate_problem(w)
    if gate:
        problems.append(gate)
    if match is not None and after is not None:
        problems += after(w, match > 0)          # the test's own continuation replaces the program's
    elif match is not None:
        try:
            for fn in accepted[j][match][1]:
                fn(w)
            for c in calls[j + 1:]:
                c.fn(w)
        except Exception as e:  # noqa: BLE001 (any failure is a finding)
            problems.append(f"completing the program raised {type(e).__name__}: {e}")
        else:
            if w.tokens() != want_tokens:
                problems.append(f"finished tokens differ: {w.tokens()} != {want_tokens}")
            elif w.digest() != want_digest:
                problems.append(f"final state differs: {diff(want_digest, w.digest())}")
    head = f"call {j} ({calls[j].label}), k={k}, Ctrl-C {ctl.how} at {ctl.fired}"
    return True, [f"{head}: {p}" for p in problems]


def sweep(ckpt, kw, calls, every: int, after=None, only=None):
    """Every trial of every call (``only``: the indexes of the calls to interrupt); returns
    (trials run, problems)."""
    accepted, want_tokens, want_digest = reference(ckpt, kw, calls)
    twin = reference(ckpt, kw, calls)
    assert twin[0] == accepted and twin[2] == want_digest, "two identical sessions give different digests"
    gc.freeze()                                  # collections after a trial scan only its objects
    try:
        return _trials(ckpt, kw, calls, every, after, only, accepted, want_tokens, want_digest)
    finally:
        gc.unfreeze()


def _trials(ckpt, kw, calls, every, after, only, accepted, want_tokens, want_digest):
    trials, problems = 0, []
    for j in (range(len(calls)) if only is None else only):
        k = 0
        while True:
            fired, found = trial(ckpt, kw, calls, j, k, accepted, want_tokens, want_digest, after)
            if not fired:
                break
            trials += 1
            problems += found
            k += every
    return trials, problems


def summary(name: str, problems: list[str]) -> str:
    """One line per distinct (landing place, what broke), with how many trials showed it."""
    seen: dict[tuple, list[str]] = {}
    for p in problems:
        head, _, what = p.partition(": ")
        at = head.split(" at ", 1)[-1]
        seen.setdefault((at, what.split(" (")[0].split(":")[0]), []).append(p)
    lines = [f"{name}: {len(seen)} distinct problems in {len(problems)} findings"]
    for found in seen.values():
        lines.append(f"  [{len(found)}x] {name}: {found[0][:700]}")
    return "\n".join(lines)


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt, as in a notebook (the process may have inherited it ignored);
    one torch thread (the trials are tiny: a second thread only waits on the other)."""
    previous, threads = signal.signal(signal.SIGINT, signal.default_int_handler), torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, previous)
