"""A Qwen2-style tokenizer built offline: a small byte-level BPE with the Qwen2 special tokens at their real ids.

The real Qwen2 vocabulary cannot be downloaded, so we train about two thousand BPE tokens on an in-code corpus of the
texts this project feeds the model (the verifier's prompts, counting questions, answer tags, digits, chat roles)
with the exact Qwen2 normalizer / pre-tokenizer / decoder. Every special token sits at the id the real model
uses, so the model config, the generation config and the processor see the ids they would see on the real box.

Non-contiguous ids: the BPE vocabulary ends after a few thousand ids while the special tokens start at 151643.
`tokenizers` assigns an added token the next free id unless the token is already in the model vocabulary, and
transformers 5 rebuilds a `Qwen2Tokenizer` from tokenizer.json's vocab and merges, re-adding special tokens from
their names (the ids in `added_tokens` are dropped). So we put the special tokens into the BPE vocabulary itself at
their real ids (a BPE vocabulary may have gaps); re-adding them then finds those ids, and the ids survive every
save/load round trip. Ids in the gap decode to nothing, and `len(tokenizer)` is the number of real tokens (~1.9k),
not 151657 as for the real tokenizer; nothing here sizes anything by it (the model keeps the real 151936 rows).
"""

from __future__ import annotations

import json

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from evaluator.protocol import EVAL_TEMPLATE, INHERITED_TEMPLATE

# The Qwen2 / Qwen2-VL special tokens in their real order, from id 151643 on.
SPECIAL_TOKENS: dict[str, int] = {
    token: 151643 + offset
    for offset, token in enumerate(
        [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
        ]
    )
}

# Qwen2-VL-2B-Instruct's chat template, verbatim (a fact of the model format): a default system turn when the
# first message is not a system message, one vision block per image or video, and the assistant header on
# `add_generation_prompt`.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_BPE_VOCAB_SIZE = 4096

_QUESTIONS = [
    "How many items are there in the image?",
    "How many objects are there?",
    "How many {a} {s}s are there?",
    "How many {a} objects are there?",
    "What number of {s}s are there?",
    "How many {s}s are left of the {a} thing?",
    "Subtract all {a} {s}s. How many objects are left?",
]
_ATTRIBUTES = (
    "red blue green gray brown purple cyan yellow small large big tiny metal metallic rubber shiny matte"
).split()
_SHAPES = "cube sphere cylinder ball block car bus bicycle motorbike aeroplane truck bike plane thing".split()
_WORDS = """
the be to of and a in that have it for not on with he as you do at this but his by from they we say her she or an
will my one all would there their what so up out if about who get which go me when make can like time no just him
know take people into year your good some could them see other than then now look only come its over think also
back after use two how our work first well way even new want because any these give day most us is are was were
been has had did does done said answer number count counting thinking final process output tags question image
picture photo scene object item thing left right front behind next same different color shape size material total
here many much few more less zero none each every both either neither system user assistant helpful let therefore
three four five six seven eight nine ten eleven twelve twenty hundred above below under between near far top bottom
side middle center corner edge line row column group pair set part whole half quarter visible hidden small medium
long short tall wide narrow round square flat dark light bright white black orange pink silver golden wooden glass
plastic stone paper cloth made look see find show tell ask check verify step reason because since while where why
again still already yet very really quite almost exactly only also too not never always sometimes often maybe
cannot should must might may need needs needed has having found counted counts numbers questions answers images
scenes pictures shapes sizes colors materials vehicle vehicles wheel wheels door doors window windows seat seats
tire tires engine fender mirror light lights part parts road ground table floor background foreground camera view
""".split()


def _corpus() -> list[str]:
    """The training texts; deterministic, so the same merges come out every time."""
    questions = [q.format(a=a, s=s) for q in _QUESTIONS for a in _ATTRIBUTES for s in _SHAPES]
    prompts = [t.format(question=q) for t in (EVAL_TEMPLATE, INHERITED_TEMPLATE) for q in questions]
    answers = [f"<think> I count {n} objects. </think> <answer> {n} </answer>" for n in range(100)]
    # Each word lower-case and capitalized, after a space and at the start of a line: distinct BPE tokens.
    words = [variant for w in _WORDS for variant in (w, w.capitalize())]
    return prompts + answers + [" ".join(words), "\n".join(words), " ".join(str(n) for n in range(100))]


def _qwen2_pipeline(tokenizer: Tokenizer) -> Tokenizer:
    """The normalizer, pre-tokenizer and decoder of transformers' `Qwen2Tokenizer`; its regex splits every digit
    into its own piece, so numbers are always single-digit tokens."""
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges of a byte-level BPE trained on the in-code corpus (all 256 bytes included)."""
    tokenizer = _qwen2_pipeline(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ") if isinstance(m, str) else m) for m in model["merges"]]
    return model["vocab"], merges


def build_tokenizer() -> Qwen2Tokenizer:
    """A `Qwen2Tokenizer` with the real Qwen2-VL tokenizer_config settings and the special tokens at their ids."""
    vocab, merges = train_bpe()
    assert max(vocab.values()) < min(SPECIAL_TOKENS.values())
    vocab.update(SPECIAL_TOKENS)  # in the BPE vocabulary itself: see the module docstring
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        # The real tokenizer_config.json: no bos, no unk, eos <|im_end|>, pad <|endoftext|>, the rest "additional".
        bos_token=None,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t != "<|endoftext|>"],
        add_prefix_space=False,
        errors="replace",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=32768,
        # Qwen2-VL ships padding_side "left" in its tokenizer_config.json (unlike the text-only Qwen2 models).
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )
