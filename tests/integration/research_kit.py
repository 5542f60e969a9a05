"""Dense Hugging Face references for the research-hook tests: activations by our hook names.

Every tensor is read from the transformers model with PyTorch module hooks (q and k after RoPE
are rebuilt with transformers' own ``apply_rotary_pos_emb``), so nothing here shares code with
qwen_npu's forward.
"""
from __future__ import annotations

import functools

import torch

from qwen_npu import SamplingParams, Session
from qwen_npu.testing import make_tiny_qwen3

TOL = 1e-4          # float32, paged vs dense: summation order differs by chunk and batch


@functools.lru_cache(maxsize=4)
def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def make_ckpt(root, layers: int = 3):
    return make_tiny_qwen3(root, vocab_size=512, num_hidden_layers=layers, tie_word_embeddings=False, seed=3)


def open_session(path, **kw) -> Session:
    args = dict(device="cpu", max_batch=4, block_size=4, chunk_size=6, max_model_len=64, num_blocks=128)
    args.update(kw)
    return Session.from_pretrained(path, **args)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def hf_activations(path, tokens: list[int], *, edits=None) -> dict[str, torch.Tensor]:
    """Our hook names -> [len(tokens), ...] from one dense HF forward (``final_norm`` and
    ``logits`` for every position). ``edits``: {"layers.{i}.attn.out" or "layers.{i}.residual":
    fn(tensor [1, tokens, hidden]) -> tensor}, applied as forward hooks on o_proj / the decoder layer."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
    model = hf_model(path)
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    handles = []

    def keep(name, shape=None):
        def hook(module, args, result):
            t = result[0] if isinstance(result, tuple) else result
            out[name] = (t[0] if shape is None else t[0].reshape(t.shape[1], *shape)).detach().clone()
        return hook

    def keep_input(name, shape=None):
        def hook(module, args, kwargs=None):
            t = args[0] if args else kwargs["hidden_states"]
            out[name] = (t[0] if shape is None else t[0].reshape(t.shape[1], *shape)).detach().clone()
        return hook

    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    m = model.model
    handles.append(m.embed_tokens.register_forward_hook(keep("embed")))
    for i, layer in enumerate(m.layers):
        p, a = f"layers.{i}.", layer.self_attn
        handles += [
            layer.register_forward_pre_hook(keep_input(p + "resid_pre"), with_kwargs=True),
            layer.post_attention_layernorm.register_forward_pre_hook(keep_input(p + "resid_mid")),
            layer.input_layernorm.register_forward_hook(keep(p + "attn.in")),
            a.q_norm.register_forward_hook(keep(p + "attn.q_pre_rope", (heads, hd))),
            a.k_norm.register_forward_hook(keep(p + "attn.k_pre_rope", (kv, hd))),
            a.v_proj.register_forward_hook(keep(p + "attn.v", (kv, hd))),
            a.o_proj.register_forward_pre_hook(keep_input(p + "attn.z", (heads, hd))),
            a.o_proj.register_forward_hook(keep(p + "attn.out")),
            layer.post_attention_layernorm.register_forward_hook(keep(p + "mlp.in")),
            layer.mlp.down_proj.register_forward_pre_hook(keep_input(p + "mlp.act")),
            layer.mlp.register_forward_hook(keep(p + "mlp.out")),
            layer.register_forward_hook(keep(p + "residual")),
        ]
        for key, module in ((p + "attn.out", a.o_proj), (p + "residual", layer)):
            if edits and key in edits:
                handles.insert(0, module.register_forward_hook(lambda mod, args, res, f=edits[key]: f(res)))
    handles.append(m.norm.register_forward_hook(keep("final_norm")))
    try:
        with torch.no_grad():
            ids = torch.tensor([tokens])
            logits = model(ids).logits[0]
            cos, sin = m.rotary_emb(out["embed"][None], torch.arange(len(tokens))[None])
    finally:
        for h in handles:
            h.remove()
    out["logits"] = logits
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}.attn."
        q, k = apply_rotary_pos_emb(out[p + "q_pre_rope"].transpose(0, 1)[None],
                                    out[p + "k_pre_rope"].transpose(0, 1)[None], cos, sin)
        out[p + "q"], out[p + "k"] = q[0].transpose(0, 1), k[0].transpose(0, 1)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        keys = out[p + "k"].repeat_interleave(group, dim=1)                     # [tokens, heads, hd]
        scores = torch.einsum("qhd,khd->qhk", out[p + "q"], keys) * cfg.head_dim ** -0.5
        future = torch.ones(len(tokens), len(tokens), dtype=torch.bool).triu(1)
        out[p + "scores"] = scores.masked_fill(future[:, None, :], float("-inf"))
    return out


def max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want|, with -inf (masked scores) equal only to -inf."""
    same_inf = torch.isinf(got) & torch.isinf(want) & (got.sign() == want.sign())
    d = (got - want).abs().masked_fill(same_inf, 0.0)
    return d.max().item() if d.numel() else 0.0


def run_forced(sess: Session, seqs: list[list[int]], prompt_lens: list[int], cap_names=None):
    """Run ``seqs`` teacher-forced (prompt = the first ``prompt_lens`` tokens, then the rest fed
    one decode step at a time); returns (requests, capture or None, {(request id, position): logits row})."""
    reqs = [sess.add_request(s[:n], greedy(len(s) - n + 1)) for s, n in zip(seqs, prompt_lens)]
    by_id = {r.id: s for r, s in zip(reqs, seqs)}
    logits = {}
    cap = sess.capture(cap_names) if cap_names is not None else None
    if cap is not None:
        cap.__enter__()
    try:
        while any(r.num_tokens < len(by_id[r.id]) for r in reqs):
            pending = [r for r in reqs if r.status in ("waiting", "prefilling")]
            step = sess.prefill() if pending else sess.decode_step()
            if step.logits is None:
                continue
            rows = step.logits.tensor.clone()
            force = {}
            for j, rid in enumerate(step.logits_request_ids):
                r = sess.request(rid)
                logits[(rid, r.num_tokens - 1)] = rows[j]
                force[rid] = by_id[rid][r.num_tokens] if r.num_tokens < len(by_id[rid]) else 0
            sess.sample(step, force=force)
    finally:
        if cap is not None:
            cap.__exit__(None, None, None)
    return reqs, cap, logits


def sequences(lens, vocab: int = 511, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
