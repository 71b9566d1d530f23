"""The bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against HF transformers
loading the same GGUF: the first 32 greedy tokens of a chat prompt are identical."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core.model_config import default_model_path

pytestmark = pytest.mark.slow  # the real default model against HF on the same GGUF


def test_default_model_first_32_greedy_tokens_equal_hf_on_the_same_gguf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_model_path()
    messages = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]

    # the dequantized float path; the GGUF's own blocks are held to it in
    # tests/model/test_quantized_weights.py
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory=0.1, max_model_len=512)
    ours = llm.chat(
        messages, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False
    )[0]

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert ours.prompt_token_ids == list(ids)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32, pad_token_id=0)
    assert ours.outputs[0].token_ids == ref[0, len(ids) :].tolist()
    assert ours.outputs[0].text.strip()  # real words, not noise


def test_a_copy_of_the_gguf_elsewhere_reuses_the_converted_folder(tmp_path, caplog):
    """The conversion cache is keyed by the file's contents, not its path: a second clone
    (or a copy) of the same model finds the first one's folder instead of writing another."""
    import logging
    import shutil

    from tandem.model.gguf import gguf_as_hf_folder

    original = gguf_as_hf_folder(default_model_path())  # converted by the test above
    copy = tmp_path / "clone" / default_model_path().name
    copy.parent.mkdir()
    shutil.copyfile(default_model_path(), copy)
    with caplog.at_level(logging.INFO, logger="tandem"):
        assert gguf_as_hf_folder(copy) == original
    assert "dequantizing" not in caplog.text
