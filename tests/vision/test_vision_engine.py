"""Requests with images through LLM.generate against input_embeddings + the text forward."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from tiny import tiny_v41
from tiny_vision import IMAGE_TOKEN, fresh_seed, random_image, tiny_vision_config

from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.api import Model, random_model
from deepinfer_fx.graphs.batch import make_batch
from deepinfer_fx.graphs.model import forward_batch
from deepinfer_fx.graphs.state import init_state
from deepinfer_fx.vision import input_embeddings
from deepinfer_fx.vision.merge import text_embeddings, token_grids
from deepinfer_fx.vision.processor import preprocess
from deepinfer_fx.vision.spans import expand_placeholders

pytest.importorskip("PIL")

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model() -> Model:
    m = random_model(tiny_vision_config(), seed=fresh_seed())
    return Model(m.config.replace(fake_quant=False), m.params)  # fake-quant moves chunked runs by ~1e-2


def reference(model: Model, ids: list[int], images: list, out: list[int]) -> torch.Tensor:
    """Log-probs at every position from the prompt's last on: one teacher-forced forward of the
    laid-out prompt plus the generated tokens, with the merged embeddings (``prompt=True``: from
    the first position)."""
    c, params = model
    seq = ids + out[:-1]
    # generated tokens are text, even the image token id (a random model may emit it): the
    # engine embeds them as text in every step, and routes none of them as a span row
    prompt = input_embeddings(model, ids, images)
    emb = torch.cat([prompt, text_embeddings(c, params, torch.tensor(out[:-1], dtype=torch.long), prompt.dtype)])
    spans = torch.tensor(ids) == IMAGE_TOKEN
    image_rows = torch.cat([spans, torch.zeros(len(out) - 1, dtype=torch.bool)])
    batch = dataclasses.replace(make_batch([seq], [0], [0]), embeds=emb, image_rows=image_rows)
    state = init_state(c, len(seq) + 1, torch.float32, "cpu", mtp=False)
    logits, _ = forward_batch(params, state, c, batch)
    return logits.log_softmax(-1)


def laid_out(model: Model, ids: list[int], images: list) -> list[int]:
    _, grids = preprocess(images, model.config)
    return expand_placeholders(ids, token_grids(model.config, grids), IMAGE_TOKEN)[0]


def run(model: Model, prompts: list, budget: int, prompt_logprobs: int | None = None) -> list:
    llm = LLM(model=model, max_num_batched_tokens=budget, max_num_seqs=4, memory_budget=64 << 20)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True, prompt_logprobs=prompt_logprobs
    )
    return llm.generate(prompts, params)


def test_generate_with_images_matches_input_embeddings(model) -> None:
    seed = fresh_seed()
    images = [random_image(100, 60, seed), random_image(45, 120, seed + 1)]
    prompts = [
        {"prompt": [5, IMAGE_TOKEN, 7, 8, IMAGE_TOKEN, 9], "multi_modal_data": {"image": images}},
        [11, 12, 13],  # a text request in the same steps
        {"prompt": [IMAGE_TOKEN, 21], "multi_modal_data": {"image": images[1]}},
    ]
    results = run(model, prompts, budget=512, prompt_logprobs=0)
    for prompt, res in zip(prompts, results):
        out = res.outputs[0]
        ids, ims = (prompt["prompt"], prompt["multi_modal_data"]["image"]) if isinstance(prompt, dict) else (prompt, [])
        ims = ims if isinstance(ims, list) else [ims]
        full = laid_out(model, ids, ims) if ims else ids
        ref = reference(model, full, ims, out.token_ids)
        gen = ref[len(full) - 1 :]
        assert out.token_ids == gen.argmax(-1).tolist()
        got = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])
        want = gen.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # every prompt position's logprob of the next prompt token, spans included
        assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(full)
        got = torch.tensor([lp[t] for lp, t in zip(res.prompt_logprobs[1:], full[1:])])
        want = ref[: len(full) - 1].gather(1, torch.tensor(full[1:])[:, None])[:, 0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_through_a_span_is_one_shot(model) -> None:
    seed = fresh_seed()
    image = random_image(100, 60, seed)
    prompt = {"prompt": [5, 6, IMAGE_TOKEN, 7], "multi_modal_data": {"image": image}}
    span = len(laid_out(model, prompt["prompt"], [image])) - 3
    assert span > 7
    one = run(model, [prompt], budget=512)[0].outputs[0]
    chunked = run(model, [prompt], budget=5)[0].outputs[0]  # chunks of 5 cut the span at 3, 8, ...
    assert chunked.token_ids == one.token_ids
    for a, b in zip(chunked.logprobs, one.logprobs):
        assert a.keys() == b.keys()
        torch.testing.assert_close(torch.tensor(list(a.values())), torch.tensor(list(b.values())), rtol=1e-4, atol=1e-4)


def test_bad_image_inputs_are_one_line_errors(model) -> None:
    llm = LLM(model=model, max_num_batched_tokens=64, max_num_seqs=2, memory_budget=32 << 20)
    image = random_image(60, 60, fresh_seed())
    cases = [
        (
            [[3, 4], {"prompt": [3, IMAGE_TOKEN, IMAGE_TOKEN], "multi_modal_data": {"image": image}}],
            r"prompts\[1\]: 2 image placeholder\(s\) \(token id 299\) but 1 image\(s\)",
        ),
        ([{"prompt": [3, 4], "multi_modal_data": {"image": image}}], r"prompts: 0 image placeholder\(s\)"),
        (
            [[1, 2], {"prompt": [IMAGE_TOKEN], "multi_modal_data": {"image": io.BytesIO(b"x").getvalue()}}],
            r"prompts\[1\]: multi_modal_data\['image'\]\[0\]: not a readable image",
        ),
        ([{"prompt": [IMAGE_TOKEN], "multi_modal_data": {"video": image}}], r"prompts: multi_modal_data takes one key"),
    ]
    for prompts, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            llm.generate(prompts if len(prompts) > 1 else prompts[0], SamplingParams(max_tokens=1))
        assert "\n" not in str(e.value)
    text_only = LLM(
        model=random_model({"model_type": "deepseek_v41", "text_config": tiny_v41()}, seed=fresh_seed()),
        max_num_batched_tokens=64,
        max_num_seqs=2,
        memory_budget=32 << 20,
    )
    with pytest.raises(ValueError, match=r"prompts\[0\]: 1 image\(s\) given, but the model has no vision tower") as e:
        text_only.generate([{"prompt": [3], "multi_modal_data": {"image": [image]}}], SamplingParams(max_tokens=1))
    assert "\n" not in str(e.value)


def test_compiled_decode_after_an_image_prefill(model) -> None:
    """The prompt ends in a span, so the compiled decode steps hash n-grams whose history is
    DEAD; they give the eager engine's tokens."""
    image = random_image(60, 60, fresh_seed())
    prompt = {"prompt": [5, IMAGE_TOKEN], "multi_modal_data": {"image": image}}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    outs = []
    for eager in (True, False):
        llm = LLM(
            model=model, eager=eager, warmup=False, max_num_batched_tokens=64, max_num_seqs=1, memory_budget=32 << 20
        )
        outs.append(llm.generate([prompt], params)[0].outputs[0])
        assert llm.options.steps.compiled == (not eager)
        if not eager:
            assert any(r["graph"].startswith("decode") for r in llm.runner.steps.report())
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(*(o.logprobs for o in outs)):
        torch.testing.assert_close(torch.tensor(list(a.values())), torch.tensor(list(b.values())), rtol=1e-4, atol=1e-4)


def test_a_generated_image_token_is_embedded_as_text(model) -> None:
    """A text row holding the image token id (a model may generate it) reads its own ``embed`` row
    in a step that merges image spans, as in a text-only step (``graphs.model.embed``), so its
    result does not depend on the step it lands in."""
    from deepinfer_fx.graphs.model import embed
    from deepinfer_fx.vision.requests import batch_embeddings

    c, params = model
    assert c.image_token_id == IMAGE_TOKEN < c.vocab_size
    ids = torch.tensor([5, IMAGE_TOKEN, 7])
    embeds, rows = batch_embeddings(model, ids, [(0, 0, 3, None)])
    assert torch.equal(embeds, embed(params, c, ids, params["norm"].dtype)[:, 0])
    assert not rows.any()


def test_batch_invariant_image_requests_alone_and_together(model) -> None:
    """With batch-invariant inference a request with an image gives the same bits alone and in
    one prefill step with another image request (each image is encoded in its own pass: packed
    in one ViT pass with the other two, the first image's bits can differ, as the GEMMs block by row count)."""
    seed = fresh_seed()
    pair = [random_image(50, 140, seed + 1), random_image(80, 80, seed + 2)]
    prompts = [
        {"prompt": [5, IMAGE_TOKEN, 7], "multi_modal_data": {"image": random_image(90, 70, seed)}},
        {"prompt": [IMAGE_TOKEN, 9, IMAGE_TOKEN], "multi_modal_data": {"image": pair}},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    llm = LLM(model=model, batch_invariant=True, max_num_batched_tokens=256, max_num_seqs=2, memory_budget=32 << 20)

    def logprobs(batch: list) -> list:
        return [[list(d.values()) for d in out.outputs[0].logprobs] for out in llm.generate(batch, params)]

    alone, together = logprobs(prompts[:1]), logprobs(prompts)
    assert together[0] == alone[0]
