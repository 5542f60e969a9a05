"""Plots return Figures with the expected artists, never touch pyplot's state, and close cleanly."""
import warnings

import pytest
from views_kit import run_two_requests, small_session

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from qwen_npu import InvalidRequestError, SamplingParams
from qwen_npu.inspect import (
    kv_norms,
    plot_cache_occupancy,
    plot_kv_norms,
    plot_rows_per_step,
    plot_step_timings,
    plot_topk,
)
from qwen_npu.inspect.plots import MISSING_GLYPH, token_label


@pytest.fixture(scope="module")
def sess(tiny_ckpt_small_vocab):
    return run_two_requests(small_session(tiny_ckpt_small_vocab), decode_steps=2)


def closes_cleanly(fig):
    assert isinstance(fig, Figure)
    fig.canvas.draw()                          # renders without error (Agg)
    before = plt.get_fignums()
    plt.close(fig)
    assert plt.get_fignums() == before == []   # never registered with pyplot


def test_cache_occupancy(sess):
    fig = plot_cache_occupancy(sess)
    ax = fig.axes[0]
    assert len(ax.collections) == 3                          # used, cached, free areas
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["used", "cached", "free"]
    assert ax.get_ylim()[1] == sess.config.num_blocks
    closes_cleanly(fig)


def test_rows_per_step_shows_partial_and_padded_batches(sess, tiny_ckpt_small_vocab):
    fig = plot_rows_per_step(sess)
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    assert heights == [s.num_active for s in sess.history]   # one bar per step, no padding bars
    assert any("max_batch 4" == t.get_text() for t in ax.get_legend().get_texts())
    closes_cleanly(fig)

    padded = small_session(tiny_ckpt_small_vocab, decode_padding="replicate", slot_check="off")
    padded.add_request([1, 2, 3], SamplingParams(max_new_tokens=3))
    padded.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        padded.step()
    fig = plot_rows_per_step(padded)
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights == [1, 1, 3]                             # active rows per step, then step 1's padding
    closes_cleanly(fig)


def test_step_timings_stack_every_phase(sess):
    fig = plot_step_timings(sess)
    ax = fig.axes[0]
    phases = [t.get_text() for t in ax.get_legend().get_texts()]
    assert phases[:2] == ["schedule", "check"] and "forward" in phases and "sample" in phases
    assert len(ax.patches) == len(phases) * len(sess.history)
    closes_cleanly(fig)


def test_topk_bars(sess):
    step = sess.last_step
    fig = plot_topk(step, request_id=0, k=4)
    ax = fig.axes[0]
    assert len(ax.patches) == 4
    widths = [p.get_width() for p in ax.patches]
    assert widths == sorted(widths, reverse=True) and 0 < widths[0] <= 1
    assert ax.get_yticklabels()[0].get_text() == str(step.token_ids.tolist()[0])
    closes_cleanly(fig)
    with pytest.raises(InvalidRequestError, match="request 7 has no logits row"):
        plot_topk(step, request_id=7)


def test_topk_labels_show_text_never_escaped_code_points(sess):
    step = sess.last_step
    fig = plot_topk(step, request_id=0, k=3, decode=lambda ids: ["\u503e\u659c", " fox", "caf\u00e9"][ids[0] % 3])
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels and all("\\u" not in label and "\\x" not in label for label in labels)
    closes_cleanly(fig)
    assert token_label("\u503e\u659c") == "'" + MISSING_GLYPH * 2 + "'"      # no glyph in the plot font: a box each
    assert token_label(" caf\u00e9") == "' caf\u00e9'"                      # glyph there: drawn as itself
    assert token_label("a\nb") == "'a\\nb'"                                # control characters stay escaped, as repr


def test_kv_norms_images(sess):
    req = sess.requests[0]
    k, v = kv_norms(sess, req)
    assert k.shape == v.shape == (2, req.num_computed_tokens)
    assert (k > 0).all() and (v > 0).all()
    fig = plot_kv_norms(sess, req)
    images = [ax.images for ax in fig.axes if ax.images]
    assert len(images) == 2 and images[0][0].get_array().shape == (2, req.num_computed_tokens)
    closes_cleanly(fig)


def test_plots_refuse_empty_input(tiny_ckpt_small_vocab):
    empty = small_session(tiny_ckpt_small_vocab)
    for plot in (plot_cache_occupancy, plot_rows_per_step, plot_step_timings):
        with pytest.raises(InvalidRequestError, match="no step has run yet"):
            plot(empty)
    req = empty.add_request([1, 2])
    with pytest.raises(InvalidRequestError, match="has no K/V in the cache"):
        plot_kv_norms(empty, req)
