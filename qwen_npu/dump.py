"""Step dumps: what each step dispatched, in a portable JSON file any runner can write.

    sess.dump("run.json")                 # the session's recent steps (sess.history)
    d = qwen_npu.load_dump("run.json")    # -> Dump: .meta, .steps, .check()
    $ qwen-npu inspect run.json           # prints every step and runs the slot checks on it

The format (``docs/dump-format.md``) is plain JSON — no pickle, nothing executable — so another
serving runner can write it from its own dispatch buffers and have ``qwen-npu inspect`` look
for KV slot collisions in it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .cache.slot_check import SlotReport, check_slot_mapping
from .errors import InvalidRequestError

FORMAT = "qwen-npu-dump"
VERSION = 1
REQUIRED = ("kind", "slot_mapping", "block_tables")
# the type of every step field a reader uses: "int", "str", "ints" (a list of ints), "rows" (a list
# of lists of ints); a "?" suffix allows null. Other fields are kept as stored, unchecked.
STEP_FIELDS = {"kind": "str", "index": "int", "slot_mapping": "ints", "block_tables": "rows",
               "query_lens": "ints?", "num_active": "int", "request_ids": "ints?", "positions": "ints?",
               "seq_lens": "ints?", "input_ids": "ints?", "token_ids": "ints?"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type_error(kind: str, value) -> str | None:
    """Why ``value`` is not of ``kind`` (see STEP_FIELDS), or None when it is."""
    if kind.endswith("?"):
        if value is None:
            return None
        kind = kind[:-1]
    if kind == "str":
        return None if isinstance(value, str) else f"must be a string, got {value!r}"
    if kind == "int":
        return None if _is_int(value) else f"must be an int, got {value!r}"
    if not isinstance(value, list):
        return f"must be a list, got {type(value).__name__} {value!r}"
    for i, item in enumerate(value):
        if kind == "rows":
            if not isinstance(item, list):
                return f"row {i} must be a list of ints, got {item!r}"
            bad = next((j for j, x in enumerate(item) if not _is_int(x)), None)
            if bad is not None:
                return f"row {i} item {bad} must be an int, got {item[bad]!r}"
        elif not _is_int(item):
            return f"item {i} must be an int, got {item!r}"
    return None


def step_to_dict(step, *, logits_topk: int = 0) -> dict:
    """A StepResult as plain JSON types. ``logits_topk=k`` adds the k largest logits per logits
    row while the step's device logits are still live (k values and ids per row cross, and are
    counted in the step's transfers before they are recorded)."""
    topk = None
    if logits_topk and step.logits is not None and not step.logits.is_stale:
        values, ids = step.logits.topk(min(int(logits_topk), step.logits.shape[1]))
        topk = {"ids": ids.tolist(), "values": values.tolist()}
    d = {
        "kind": step.kind, "index": step.index, "batch_size": step.batch_size, "num_active": step.num_active,
        "request_ids": list(step.request_ids), "input_ids": _ints(step.input_ids),
        "positions": _ints(step.positions), "slot_mapping": _ints(step.slot_mapping),
        "query_lens": _ints(step.query_lens), "seq_lens": _ints(step.seq_lens),
        "block_tables": [_trim(row) for row in step.block_tables.tolist()],
        "logits_request_ids": list(step.logits_request_ids),
        "token_ids": None if step.sampled_tokens is None else list(step.sampled_tokens),
        "transfers": dict(step.transfers), "timings": {k: float(v) for k, v in step.timings.items()},
        "slot_problems": [str(p) for p in step.slot_problems],
    }
    if getattr(step, "row_kinds", None):
        d["row_kinds"] = list(step.row_kinds)
    drafts = getattr(step, "drafts", None)
    if drafts:                                   # a verification step: per request, its drafts and their fate
        d["drafts"] = [[rid, list(ts)] for rid, ts in drafts.items()]
        if step.accepted:
            d["accepted"] = [[rid, int(n)] for rid, n in step.accepted.items()]
            d["rolled_back"] = [[rid, [int(s) for s in slots]] for rid, slots in step.rolled_back.items()]
    if getattr(step, "block_size", None):
        d["block_size"] = int(step.block_size)
    if getattr(step, "cache_usage", None):
        d["cache_usage"] = dict(step.cache_usage)
    if topk is not None:
        d["logits_topk"] = topk
    return d


def session_meta(sess) -> dict:
    c, m = sess.config, sess.model_config
    return {"block_size": c.block_size, "num_blocks": c.num_blocks, "max_batch": c.max_batch,
            "chunk_size": c.chunk_size, "decode_padding": c.decode_padding, "slot_check": c.slot_check,
            "mixed_steps": c.mixed_steps,
            "device": c.device, "dtype": c.dtype, "kernels": c.kernels,
            "model": str(sess.path) if sess.path else None, "num_layers": m.num_hidden_layers,
            "vocab_size": m.vocab_size}


def write_dump(path, steps: list[dict], meta: dict) -> Path:
    """Write step dicts and run metadata (at least ``block_size``) to ``path`` as JSON."""
    path = Path(path)
    doc = {"format": FORMAT, "version": VERSION, "meta": meta, "steps": steps}
    path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    return path


def dump_session(sess, path, steps=None, *, logits_topk: int = 0) -> Path:
    """``sess.dump``: ``steps`` = StepResults or step indices from ``sess.history`` (default all)."""
    history = list(sess.history)
    if steps is None:
        chosen = history
    else:
        by_index = {s.index: s for s in history}
        chosen = []
        for s in steps:
            if isinstance(s, int) and s not in by_index:
                kept = f"{history[0].index}..{history[-1].index}" if history else "none"
                raise InvalidRequestError(f"dump: step {s} is not in sess.history (steps kept: {kept})")
            chosen.append(by_index[s] if isinstance(s, int) else s)
    return write_dump(path, [step_to_dict(s, logits_topk=logits_topk) for s in chosen], session_meta(sess))


def _pairs(value, name: str, number: int, where: str) -> dict | None:
    """A [[request id, value], ...] field as {request id: value}; None when absent."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 and _is_int(p[0]) for p in value):
        raise InvalidRequestError(f"{where}: step #{number} field {name!r} must be [[request id, value], ...], "
                                  f"got {value!r}")
    return {p[0]: p[1] for p in value}


@dataclasses.dataclass(frozen=True)
class DumpStep:
    """One step read back from a dump (plain lists; optional fields None when absent)."""

    kind: str
    index: int
    slot_mapping: list[int]
    block_tables: list[list[int]]
    query_lens: list[int]
    num_active: int
    request_ids: list[int]
    positions: list[int] | None = None
    seq_lens: list[int] | None = None
    input_ids: list[int] | None = None
    token_ids: list[int] | None = None
    row_kinds: list[str] | None = None     # per row "decode" | "prefill" (always there for "mixed")
    drafts: dict | None = None             # a verification step's: request id -> its drafts
    accepted: dict | None = None           # request id -> drafts kept (after sampling)
    rolled_back: dict | None = None        # request id -> the slots of its rejected drafts
    raw: dict = dataclasses.field(default_factory=dict, repr=False)   # every field as stored

    @property
    def batch_size(self) -> int:
        return len(self.block_tables)

    @classmethod
    def from_dict(cls, d: dict, number: int, where: str = "dump") -> DumpStep:
        if not isinstance(d, dict):
            raise InvalidRequestError(f"{where}: step #{number} must be a JSON object, got {d!r}")
        missing = [k for k in REQUIRED if k not in d]
        if missing:
            raise InvalidRequestError(f"{where}: step #{number} lacks {', '.join(missing)}")
        for name, kind in STEP_FIELDS.items():
            why = _type_error(kind, d[name]) if name in d else None
            if why is not None:
                raise InvalidRequestError(f"{where}: step #{number} field {name!r} {why}")
        rows = len(d["block_tables"])
        qls = d.get("query_lens") or [1] * rows
        kinds = d.get("row_kinds")
        if d["kind"] == "mixed" and (not isinstance(kinds, list) or len(kinds) != rows):
            raise InvalidRequestError(f"{where}: step #{number} is mixed but its row_kinds does not name "
                                      f"the kind of each of its {rows} rows")
        if kinds is not None and any(k not in ("decode", "prefill") for k in kinds):
            raise InvalidRequestError(f"{where}: step #{number}: row_kinds holds {kinds!r}; "
                                      f"each must be 'decode' or 'prefill'")
        spec = {name: _pairs(d.get(name), name, number, where) for name in ("drafts", "accepted", "rolled_back")}
        return cls(kind=d["kind"], index=int(d.get("index", number)), slot_mapping=list(d["slot_mapping"]),
                   block_tables=[list(r) for r in d["block_tables"]], query_lens=list(qls),
                   num_active=int(d.get("num_active", rows)),
                   request_ids=list(d.get("request_ids") or range(rows)),
                   positions=d.get("positions"), seq_lens=d.get("seq_lens"), input_ids=d.get("input_ids"),
                   token_ids=d.get("token_ids"), row_kinds=kinds, **spec, raw=d)

    def check(self, block_size: int, num_blocks: int | None = None) -> SlotReport:
        """``check_slot_mapping`` on this step (rows at and past ``num_active`` are padding)."""
        return check_slot_mapping(self.slot_mapping, self.block_tables, block_size, positions=self.positions,
                                  seq_lens=None if self.positions else self.seq_lens, num_blocks=num_blocks,
                                  active_rows=self.num_active, query_lens=self.query_lens)

    def summary(self) -> str:
        pad = f", {self.num_active} active" if self.num_active != self.batch_size else ""
        toks = "" if self.token_ids is None else f"; sampled {self.token_ids}"
        kind = self.kind
        if self.kind == "mixed":
            d = self.row_kinds.count("decode")
            kind = f"mixed: {d} decode, {len(self.row_kinds) - d} prefill"
        if self.drafts:
            n = sum(len(v) for v in self.drafts.values())
            kept = "" if self.accepted is None else f", {sum(self.accepted.values())} kept"
            kind += f": {n} draft{'s' * (n != 1)}{kept}"
        recorded = self.raw.get("request_ids") if self.raw else self.request_ids
        who = f"requests {list(recorded[:self.num_active])}" if recorded else "no request ids recorded"
        padding = self.batch_size - self.num_active
        if recorded and padding > 0:                     # padding rows repeat an id; they are not requests
            who += f" + {padding} padding row{'s' if padding > 1 else ''}"
        return f"step {self.index} ({kind}): {self.batch_size} rows{pad}, {sum(self.query_lens)} tokens, {who}{toks}"


@dataclasses.dataclass(frozen=True)
class Dump:
    """A dump file read back: ``meta`` (run settings) and ``steps`` in file order."""

    meta: dict
    steps: list[DumpStep]
    path: Path | None = None

    @property
    def block_size(self) -> int:
        return int(self.meta["block_size"])

    def check(self) -> list[tuple[DumpStep, SlotReport]]:
        """The slot report of every step, in order."""
        return [(s, s.check(self.block_size, self.meta.get("num_blocks"))) for s in self.steps]

    def __repr__(self) -> str:
        return format_dump(self)


def load_dump(path) -> Dump:
    """Read a dump written by ``sess.dump`` or by any runner following docs/dump-format.md."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidRequestError(f"{path}: not a readable JSON dump ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise InvalidRequestError(f"{path}: not a {FORMAT} file (its 'format' field must be {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise InvalidRequestError(f"{path}: dump version {doc.get('version')!r}; this reader knows {VERSION}")
    meta = doc.get("meta") or {}
    if not isinstance(meta, dict):
        raise InvalidRequestError(f"{path}: field 'meta' must be a JSON object, got {meta!r}")
    if "block_size" not in meta:
        raise InvalidRequestError(f"{path}: meta.block_size is missing (the slot checks need it)")
    for name in ("block_size", "num_blocks"):
        v = meta.get(name)
        if name in meta and (not _is_int(v) or v < 1) and not (name == "num_blocks" and v is None):
            raise InvalidRequestError(f"{path}: field 'meta.{name}' must be an int >= 1, got {v!r}")
    raw_steps = doc.get("steps") or []
    if not isinstance(raw_steps, list):
        raise InvalidRequestError(f"{path}: field 'steps' must be a list, got {type(raw_steps).__name__}")
    steps = [DumpStep.from_dict(d, i, str(path)) for i, d in enumerate(raw_steps)]
    return Dump(meta, steps, path)


def format_dump(dump: Dump, *, verbose: bool = False) -> str:
    """Every step with its slot report, as ``qwen-npu inspect`` prints it."""
    m = dump.meta
    head = ", ".join(f"{k}={m[k]}" for k in ("model", "device", "block_size", "num_blocks", "max_batch",
                                             "decode_padding") if m.get(k) is not None)
    lines = [f"dump {dump.path or ''}: {len(dump.steps)} steps ({head})"]
    bad = 0
    for step, report in dump.check():
        lines.append(step.summary())
        if verbose:
            lines.append(f"  positions    {step.positions}")
            lines.append(f"  slot_mapping {step.slot_mapping}")
            lines += [f"  row {r} blocks {t}" for r, t in enumerate(step.block_tables)]
        if report.ok:
            lines.append("  slots ok")
        else:
            bad += 1
            lines += [f"  PROBLEM {p}" for p in report.problems]
    lines.append(f"{bad} of {len(dump.steps)} steps have slot problems" if bad else "all steps ok")
    return "\n".join(lines)


def add_inspect_parser(subparsers) -> None:
    """Register ``qwen-npu inspect DUMP [-v]`` on an argparse subparsers object."""
    p = subparsers.add_parser("inspect", help="print a step dump and run the slot checks on every step")
    p.add_argument("dump", help="a JSON dump written by sess.dump() or another runner (docs/dump-format.md)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print positions, slots and block tables")
    p.set_defaults(handler=run_inspect)


def run_inspect(args) -> int:
    """Exit status 0 when every step is clean, 1 when any has slot problems, 2 for a bad file."""
    try:
        dump = load_dump(args.dump)
    except InvalidRequestError as e:
        print(f"qwen-npu inspect: {e}")
        return 2
    print(format_dump(dump, verbose=args.verbose))
    return 1 if any(not r.ok for _, r in dump.check()) else 0


def _ints(t) -> list[int]:
    return [int(x) for x in (t.tolist() if hasattr(t, "tolist") else t)]


def _trim(row: list[int]) -> list[int]:
    """Drop the -1 padding at the end of a block-table row."""
    n = len(row)
    while n and row[n - 1] < 0:
        n -= 1
    return row[:n]
