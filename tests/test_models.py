"""The synthetic Qwen2-VL folders load and behave like the real Qwen2-VL-2B-Instruct folder, offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from qwen_vl_utils import process_vision_info
from transformers import (
    AutoProcessor,
    AutoTokenizer,
    GenerationConfig,
    Qwen2Tokenizer,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
)

from evaluator.protocol import build_messages
from synthetic.models import SIZES, build_config, build_model
from synthetic.tokenizer import SPECIAL_TOKENS, train_bpe

IMAGE_PAD = 151655


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> Qwen2VLProcessor:
    return AutoProcessor.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Qwen2Tokenizer:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Qwen2VLForConditionalGeneration:
    return Qwen2VLForConditionalGeneration.from_pretrained(tiny_model_dir).eval()


def test_tiny_folder_loads_like_the_real_one(tiny_model_dir, model, processor, tokenizer):
    assert isinstance(processor, Qwen2VLProcessor)
    assert type(processor.image_processor) is Qwen2VLImageProcessor
    assert isinstance(tokenizer, Qwen2Tokenizer)
    image = processor.image_processor
    assert (image.patch_size, image.merge_size, image.temporal_patch_size) == (14, 2, 2)
    assert (image.size["shortest_edge"], image.size["longest_edge"]) == (3136, 12845056)
    assert list(image.image_mean) == [0.48145466, 0.4578275, 0.40821073]
    assert list(image.image_std) == [0.26862954, 0.26130258, 0.27577711]

    config = model.config
    assert (config.image_token_id, config.video_token_id) == (151655, 151656)
    assert (config.vision_start_token_id, config.vision_end_token_id) == (151652, 151653)
    assert (config.text_config.bos_token_id, config.text_config.eos_token_id) == (151643, 151645)
    assert config.text_config.vocab_size == 151936 and config.tie_word_embeddings
    assert model.dtype == torch.float32

    generation = GenerationConfig.from_pretrained(tiny_model_dir)
    assert (generation.bos_token_id, generation.pad_token_id) == (151643, 151643)
    assert generation.eos_token_id == [151645, 151643]
    assert generation.do_sample and (generation.temperature, generation.top_p, generation.top_k) == (0.01, 0.001, 1)
    assert generation.repetition_penalty == 1.0
    assert sum(f.stat().st_size for f in tiny_model_dir.iterdir()) < 60e6


def test_special_tokens_at_their_real_ids(tokenizer, processor):
    for tok in (tokenizer, processor.tokenizer):
        assert {token: tok.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS} == SPECIAL_TOKENS
        assert [tok.decode([i]) for i in SPECIAL_TOKENS.values()] == list(SPECIAL_TOKENS)
        assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 151645)
        assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 151643)
        assert tok.bos_token is None and tok.padding_side == "left" and tok.model_max_length == 32768
    ids = tokenizer("<|im_start|>assistant\n<|vision_start|><|image_pad|><|vision_end|><|im_end|>").input_ids
    assert ids[0] == 151644 and ids[-4:] == [151652, 151655, 151653, 151645]


def test_answer_round_trips_and_digits_are_single_tokens(tokenizer):
    text = "<answer> 12 </answer>"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    for n in range(100):
        pieces = tokenizer.tokenize(str(n))
        assert pieces == list(str(n)), pieces
    assert [tokenizer.convert_ids_to_tokens(i) for i in tokenizer.encode(" 42")] == ["Ġ", "4", "2"]
    # Words of the prompts are whole tokens: the BPE was trained on them.
    assert tokenizer.tokenize(" How many objects") == ["ĠHow", "Ġmany", "Ġobjects"]


def test_bpe_training_is_deterministic():
    vocab, merges = train_bpe()
    assert (vocab, merges) == train_bpe()
    assert 1000 < len(vocab) < min(SPECIAL_TOKENS.values())


def test_chat_template_is_qwen2_vl(processor, tokenizer):
    image = Image.new("RGB", (56, 56))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}]}]
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(with_system, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )


def test_the_verifiers_path_runs(model, processor):
    # Two images of different sizes in one left-padded batch, as the evaluator batches them.
    questions = ["How many items are there in the image?", "How many red cubes are there?"]
    messages = [build_messages(Image.new("RGB", size, "gray"), q) for size, q in zip([(90, 60), (60, 60)], questions)]
    texts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    images, videos = process_vision_info(messages)
    assert videos is None
    inputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
    per_row = (inputs["input_ids"] == IMAGE_PAD).sum(dim=1).tolist()
    assert per_row == (inputs["image_grid_thw"].prod(dim=1) // 4).tolist()
    assert inputs["attention_mask"][:, -1].all()  # left padding: every prompt ends at the last column

    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=8)
    assert out.shape[0] == 2 and inputs["input_ids"].shape[1] < out.shape[1] <= inputs["input_ids"].shape[1] + 8
    processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_build_is_deterministic_by_seed(tiny_model_dir, tmp_path):
    again = build_model(tmp_path / "again", size="tiny", seed=0)
    other = build_model(tmp_path / "other", size="tiny", seed=1)
    weights = (tiny_model_dir / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "processor_config.json"):
        assert (again / name).read_text() == (tiny_model_dir / name).read_text()


def test_2b_config_is_the_real_architecture():
    config = build_config("2b")
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (1536, 8960, 28)
    assert (text.num_attention_heads, text.num_key_value_heads, text.vocab_size) == (12, 2, 151936)
    assert text.rope_parameters["mrope_section"] == [16, 24, 24]
    assert text.rope_parameters["rope_theta"] == 1e6 and text.max_position_embeddings == 32768
    assert config.tie_word_embeddings
    assert (vision.depth, vision.embed_dim, vision.hidden_size, vision.num_heads) == (32, 1280, 1536, 16)
    assert (vision.mlp_ratio, vision.patch_size, vision.spatial_merge_size) == (4, 14, 2)
    assert (vision.temporal_patch_size, vision.in_channels) == (2, 3)
    with torch.device("meta"):  # no weights allocated
        model = Qwen2VLForConditionalGeneration(config)
    assert 2.0e9 < sum(p.numel() for p in model.parameters()) < 2.3e9


@pytest.mark.parametrize("size", sorted(SIZES))
def test_every_size_builds_a_valid_config(size):
    config = build_config(size)
    head_dim = config.text_config.hidden_size // config.text_config.num_attention_heads
    assert sum(config.text_config.rope_parameters["mrope_section"]) * 2 == head_dim
    assert config.vision_config.hidden_size == config.text_config.hidden_size


def test_unknown_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown size"):
        build_model(tmp_path, size="7b")
