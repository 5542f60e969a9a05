"""The ipywidgets explorer, driven without a browser: press buttons, move the slider, pick slots."""
import pytest
from views_kit import small_session

pytest.importorskip("ipywidgets")

from qwen_npu.inspect import explore
from qwen_npu.inspect.explorer import parse_prompt


@pytest.fixture
def explorer(tiny_ckpt_small_vocab):
    return explore(small_session(tiny_ckpt_small_vocab), k=3, max_new_tokens=4)


def add(ex, prompt: str):
    ex.prompt.value = prompt
    ex.add_button.click()


def test_parse_prompt():
    assert parse_prompt("1, 2,3") == [1, 2, 3]
    assert parse_prompt(" 7 ") == [7]
    assert parse_prompt("hello, world") == "hello, world"


def test_buttons_drive_the_same_session(explorer):
    ex, sess = explorer, explorer.session
    assert "ready" in ex.message.value and "no requests" in ex.session_view.value
    assert ex.history.disabled and "no step has run yet" in ex.step_view.value
    add(ex, "1,2,3,4,5,6,7,8,9,10")
    add(ex, "20, 21, 22")
    assert [r.prompt_token_ids for r in sess.requests] == [list(range(1, 11)), [20, 21, 22]]
    assert all(r.sampling.max_new_tokens == 4 for r in sess.requests)
    assert ex.prompt.value == "" and "added request 1 (3 prompt tokens)" in ex.message.value
    assert "2 waiting" in ex.session_view.value

    ex.prefill_button.click()                      # 8 tokens of request 0: no logits to sample
    assert len(sess.history) == 1 and sess.last_step.kind == "prefill"
    assert "step 0 ran 1 row(s), 8 token(s)" in ex.message.value
    assert "the last step produced no logits" in ex.topk_view.value
    ex.prefill_button.click()                      # the rest of both prompts; sampled right away
    assert sess.last_step.sampled and [r.status for r in sess.requests] == ["decoding", "decoding"]
    assert "sampled" in ex.message.value and "Top-3 next tokens" in ex.topk_view.value

    ex.decode_button.click()
    assert sess.last_step.kind == "decode" and sess.last_step.batch_size == 2
    ex.step_button.click()
    assert len(sess.history) == 4 and all(len(r.output_token_ids) == 3 for r in sess.requests)
    # the slider follows the newest step; moving it shows an older one
    assert (ex.history.max, ex.history.value) == (3, 3) and "Step 3: decode" in ex.step_view.value
    ex.history.value = 0
    assert "Step 0: prefill" in ex.step_view.value and "0..7" in ex.step_view.value
    # the request table and block grid follow the session
    assert "2 decoding" in ex.session_view.value and "block 2 (slots 8..11): used" in ex.session_view.value


def test_slot_inspector(explorer):
    ex, sess = explorer, explorer.session
    add(ex, "5,6,7")
    ex.step_button.click()
    ex.slot.value = 2                               # block 0, offset 2: request 0, position 2
    assert "Slot 2" in ex.slot_view.value and "position 2" in ex.slot_view.value
    assert "K/V norms" in ex.slot_view.value
    ex.slot.value = 40
    assert "never written" in ex.slot_view.value and "nobody" in ex.slot_view.value
    assert ex.slot.max == sess.config.num_blocks * sess.config.block_size - 1


def test_errors_are_shown_not_raised(explorer):
    ex, sess = explorer, explorer.session
    ex.decode_button.click()
    assert "decode step failed: InvalidRequestError" in ex.message.value and "add a request first" in ex.message.value
    add(ex, "   ")
    assert "add request failed" in ex.message.value and sess.requests == []
    add(ex, "hello")                               # no tokenizer in a vocab-512 checkpoint
    assert "prompts must be lists of token ids" in ex.message.value and sess.requests == []
    add(ex, "1, 999")                              # outside the vocabulary
    assert "outside the vocabulary" in ex.message.value
    # without auto-sampling the next step is refused until "sample" is pressed
    add(ex, "1,2")
    ex.auto_sample.value = False
    ex.prefill_button.click()
    assert not sess.last_step.sampled
    ex.decode_button.click()
    assert "has unsampled rows" in ex.message.value
    ex.sample_button.click()
    assert "sampled 1 token(s) of step 0" in ex.message.value and sess.last_step.sampled
    ex.sample_button.click()
    assert "already sampled" in ex.message.value


def test_refresh_picks_up_code_driven_steps_and_the_bundle_is_stable(explorer):
    ex, sess = explorer, explorer.session
    sess.add_request([9, 8, 7])
    sess.step()
    assert "no requests" in ex.session_view.value      # not redrawn yet
    ex.refresh_button.click()
    assert "1 decoding" in ex.session_view.value and ex.history.max == 0
    bundle = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == repr(ex) == ("Explorer(session with 1 requests, 1 steps in history; "
                                                "display it in a notebook to use the buttons)")


def test_a_closed_session_is_reported_not_raised(explorer):
    ex, sess = explorer, explorer.session
    sess.close()
    ex.refresh_button.click()
    assert "cannot draw the session: session is closed" in ex.session_view.value
    ex.step_button.click()
    assert "step failed: InvalidRequestError" in ex.message.value and "session is closed" in ex.message.value


def test_refresh_reads_the_top_k_once_per_step(explorer):
    ex, sess = explorer, explorer.session
    add(ex, "1,2,3")
    ex.step_button.click()
    d2h = sess.last_step.transfers["d2h"]
    ex.refresh_button.click()
    ex.refresh_button.click()
    assert sess.last_step.transfers["d2h"] == d2h           # no new copy for the same step
    ex.step_button.click()
    assert "step 1" in ex.topk_view.value


def test_a_long_action_shows_progress_and_an_interrupt_gives_the_controls_back(explorer):
    ex, sess = explorer, explorer.session
    add(ex, "1,2,3")
    seen = []

    def look(x):                     # runs inside the step: what the page shows meanwhile
        seen.append((ex.busy.value, [c.disabled for c in ex._controls]))

    with sess.intervene("embed", look):
        ex.step_button.click()
    assert "<progress" in seen[0][0] and "running step" in seen[0][0] and all(seen[0][1])
    assert ex.busy.value == "" and not any(c.disabled for c in ex._controls)

    def interrupt(x):
        raise KeyboardInterrupt

    with sess.intervene("embed", interrupt):
        ex.decode_button.click()                     # Ctrl-C in the middle of the forward
    assert "decode step interrupted" in ex.message.value and len(sess.history) == 1
    assert ex.busy.value == "" and not any(c.disabled for c in ex._controls)
    ex.decode_button.click()                         # the session goes on where it was
    assert "decode step: step 1 ran 1 row(s)" in ex.message.value
