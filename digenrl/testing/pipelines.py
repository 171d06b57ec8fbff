"""Tiny pipelines of each supported family, built from the real diffusers and
transformers classes with small configs and random weights, saved with the pipeline's
own ``save_pretrained``.

Tokenizers are made here too: a byte-level BPE vocabulary in CLIPTokenizer's form (the
256 byte symbols, with and without the end-of-word mark, and a few merges); a
SentencePiece unigram model trained on the built-in prompts for T5 / UMT5 (so a prompt
with characters it never saw, e.g. Japanese, has unknown tokens); and byte-level BPEs
trained with the ``tokenizers`` library on the prompts and the pipelines' prompt
templates for the language-model encoders (Qwen2's for Qwen-Image, Llama-3's for
HunyuanVideo), whose special tokens and words are single tokens as in the real ones, so
the pipelines' template prefixes (34 and 64 tokens for Qwen-Image and its edit
pipeline, 95 for HunyuanVideo) end where the prompt begins, as they do there.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import torch

#: Sequence length of the T5 / UMT5 encodings in these pipelines (model.max_sequence_length).
MAX_SEQUENCE_LENGTH = 16
#: Image (and video frame) size in pixels, and frames of a video.
SIZE, FRAMES = 32, 5
#: Image size of the editing pipelines (their VAEs compress 16 x, so 2 x 2 tokens).
EDIT_SIZE = 64

_TOKENIZERS: dict[str, object] = {}


def _corpus() -> list[str]:
    from digenrl.prompts import PROMPT_SETS

    # The animal sets only: a tokenizer trained on more text splits these prompts (and
    # so every test's) differently.
    words = [p for name in ("simple_animals", "animal_photos") for p in PROMPT_SETS[name]]
    return words + ["a red fox in the snow", "a blue bird on a branch", "an astronaut",
                    "a photo of a cat", "a dog running in the park", "blurry, low quality"]


def _templates() -> list[str]:
    """The prompt templates of the language-model pipelines, each with a prompt."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    from digenrl.models.qwenimage import pipeline_defaults

    qwen = [pipeline_defaults(name).prompt_template_encode
            for name in ("QwenImagePipeline", "QwenImageEditPipeline")]
    return [t.format("a photo of a cat") for t in qwen + [DEFAULT_PROMPT_TEMPLATE["template"]]]


def _byte_level_bpe(specials: list[str], split: str):
    """A byte-level BPE (``tokenizers``) trained on the prompts and the templates: every
    word they hold is one token, any text encodes (no unknown tokens); ``split`` is the
    pre-tokenizer's regular expression."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # Trained on the text between special tokens, as the tokenizer will see it.
    pieces = [piece for text in _corpus() + _templates()
              for piece in re.split("|".join(map(re.escape, specials)), text) if piece]
    tok.train_from_iterator(pieces, trainer)
    return tok


#: Qwen2's pre-tokenizer split; Llama-3's differs in grouping up to three digits.
_QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
               r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_LLAMA_SPLIT = _QWEN_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|")
#: Qwen2.5-VL's special tokens: text end (also padding), chat turns, vision markers.
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>", "<|pad|>"]


def qwen_tokenizer():
    """A Qwen2Tokenizer over a byte-level BPE, with Qwen2.5-VL's special tokens."""
    if "qwen" not in _TOKENIZERS:
        import json

        from transformers import Qwen2Tokenizer

        tok = _byte_level_bpe(QWEN_SPECIALS, _QWEN_SPLIT)
        merges = [tuple(m) for m in json.loads(tok.to_str())["model"]["merges"]]
        qwen = Qwen2Tokenizer(vocab=tok.get_vocab(), merges=merges)
        qwen.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
        _TOKENIZERS["qwen"] = qwen
    return _TOKENIZERS["qwen"]


def llama_tokenizer():
    """A Llama tokenizer over a byte-level BPE (the LLaVA-Llama-3 kind HunyuanVideo
    uses): begin-of-text first, padding on the right."""
    if "llama" not in _TOKENIZERS:
        from tokenizers import processors
        from transformers import LlamaTokenizer

        tok = _byte_level_bpe(_LLAMA_SPECIALS, _LLAMA_SPLIT)
        bos = _LLAMA_SPECIALS[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])
        _TOKENIZERS["llama"] = LlamaTokenizer(
            tokenizer_object=tok, bos_token=bos, eos_token=_LLAMA_SPECIALS[1],
            pad_token=_LLAMA_SPECIALS[-1], padding_side="right")
    return _TOKENIZERS["llama"]


def clip_tokenizer(max_length: int = 16):
    """A CLIPTokenizer over byte-level symbols (any text encodes; nothing is unknown)."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    for c in alphabet:
        vocab[c] = len(vocab)
    for c in alphabet:
        vocab[c + "</w>"] = len(vocab)
    merges = [("t", "h"), ("th", "e</w>"), ("o", "f</w>"), ("c", "a"),
              ("ca", "t</w>"), ("d", "o"), ("do", "g</w>")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def t5_tokenizer():
    """A T5Tokenizer from a SentencePiece unigram model trained here on the prompts
    (pad 0, end 1, unknown 2, as T5's)."""
    if "t5" not in _TOKENIZERS:
        import sentencepiece as spm
        from transformers import T5Tokenizer

        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(_corpus()), model_writer=buf, vocab_size=120,
            pad_id=0, eos_id=1, unk_id=2, bos_id=-1, model_type="unigram",
            hard_vocab_limit=False, character_coverage=1.0, minloglevel=2)
        sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
        vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
        _TOKENIZERS["t5"] = T5Tokenizer(vocab=vocab, extra_ids=0)
    return _TOKENIZERS["t5"]


def clip_encoder(tokenizer, hidden: int, seed: int, projection: bool = True):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                            intermediate_size=2 * hidden, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=tokenizer.model_max_length,
                            projection_dim=hidden, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls(config).eval()


def t5_encoder(tokenizer, d_model: int, seed: int, umt5: bool = False):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    kw = dict(vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=2 * d_model,
              num_layers=1, num_heads=2, relative_attention_num_buckets=8,
              pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    if umt5:
        return UMT5EncoderModel(UMT5Config(**kw)).eval()
    return T5EncoderModel(T5Config(**kw)).eval()


def _vae(seed: int, **kw):
    """A 3-block AutoencoderKL (8x8x4 latents of 32-pixel images unless ``kw`` says
    otherwise)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    config = {"block_out_channels": (8, 8, 8), "latent_channels": 4, "norm_num_groups": 8,
              "sample_size": SIZE, **kw}
    return AutoencoderKL(in_channels=3, out_channels=3,
                         down_block_types=("DownEncoderBlock2D",) * 3,
                         up_block_types=("UpDecoderBlock2D",) * 3, layers_per_block=1,
                         **config).eval()


def save_sd3(folder: Path, seed: int = 0, text_seed: int = 100) -> Path:
    """StableDiffusion3Pipeline: CLIP-L, CLIP-G and T5 (widths 8, 8, 32), MMDiT on 8x8x4
    latents, 3-block VAE with SD3's scaling and shift."""
    from diffusers import (FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
        caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=8)
    tok = clip_tokenizer()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(seed + 1, scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=clip_encoder(tok, 8, text_seed), tokenizer=tok,
        text_encoder_2=clip_encoder(tok, 8, text_seed + 1), tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5_encoder(t5_tokenizer(), 32, text_seed + 2),
        tokenizer_3=t5_tokenizer())
    pipe.save_pretrained(folder)
    return folder


def save_sd3_default_compute(folder: Path, seed: int = 0, text_seed: int = 100) -> Path:
    """StableDiffusion3Pipeline with the compute of the built-in default model: its
    transformer (8 layers x 4 heads x 32, 4.66M parameters) on 16-channel latents of
    64-pixel images (64 image tokens), CLIP-L/G-like encoders (width 16) with 77
    positions and a T5-like encoder (width 64), so a prompt is 77 + 128 text tokens as
    flow_grpo encodes it: the folder of ``workflows/peer_flow_grpo.py``."""
    from diffusers import (FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=8,
        attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64,
        caption_projection_dim=128, pooled_projection_dim=32, pos_embed_max_size=16)
    tok = clip_tokenizer(77)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(seed + 1, latent_channels=16, block_out_channels=(32, 64, 64),
                 norm_num_groups=32, sample_size=64, scaling_factor=1.5305,
                 shift_factor=0.0609),
        text_encoder=clip_encoder(tok, 16, text_seed), tokenizer=tok,
        text_encoder_2=clip_encoder(tok, 16, text_seed + 1), tokenizer_2=clip_tokenizer(77),
        text_encoder_3=t5_encoder(t5_tokenizer(), 64, text_seed + 2),
        tokenizer_3=t5_tokenizer())
    pipe.save_pretrained(folder)
    return folder


def save_flux(folder: Path, seed: int = 0, text_seed: int = 100) -> Path:
    """FluxPipeline: CLIP-L (pooled, width 8) and T5 (width 32), a guidance-embedding
    transformer on packed 8x8x4 latents, FLUX's dynamic shifting and VAE scaling."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=8, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)
    tok = clip_tokenizer()
    pipe = FluxPipeline(
        transformer=transformer, scheduler=scheduler,
        vae=_vae(seed + 1, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=clip_encoder(tok, 8, text_seed, projection=False), tokenizer=tok,
        text_encoder_2=t5_encoder(t5_tokenizer(), 32, text_seed + 2),
        tokenizer_2=t5_tokenizer())
    pipe.save_pretrained(folder)
    return folder


def save_wan(folder: Path, seed: int = 0, text_seed: int = 100) -> Path:
    """WanPipeline: UMT5 (width 32), a 3D transformer on 4-channel latents, the Wan VAE
    (8x spatial, 4x temporal) with its latents mean / std, flow-matching Euler."""
    from diffusers import (AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline,
                           WanTransformer3DModel)

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=16, ffn_dim=32, num_layers=1,
        rope_max_seq_len=32)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True],
                           latents_mean=[0.1, -0.2, 0.3, 0.0],
                           latents_std=[1.5, 0.8, 2.0, 1.2]).eval()
    pipe = WanPipeline(
        tokenizer=t5_tokenizer(), text_encoder=t5_encoder(t5_tokenizer(), 32, text_seed,
                                                           umt5=True),
        vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer)
    pipe.save_pretrained(folder)
    return folder


def _qwen_encoder(tokenizer, seed: int):
    """A Qwen2.5-VL (text model width 16, two layers; a one-block vision tower) whose
    special token ids are the tokenizer's."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("bos_token_id", "<|endoftext|>"), ("eos_token_id", "<|im_end|>"))}
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2,
                     "vocab_size": len(tokenizer), "rope_theta": 1000000.0,
                     "bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"],
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default",
                                      "type": "default"}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": 16},
        vocab_size=len(tokenizer), **ids)
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _qwen_parts(seed: int, text_seed: int, downsamples: int) -> dict:
    """The parts QwenImagePipeline and QwenImageEditPipeline share: an MMDiT on
    2x2-packed 4-channel latents, a Qwen-Image VAE compressing 2^``downsamples`` x with
    its latents mean / std, Qwen-Image's scheduler (dynamic exponential shifting with a
    terminal sigma), Qwen2.5-VL and its tokenizer."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,
                           QwenImageTransformer2DModel)

    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4))
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(
        base_dim=4, z_dim=4, dim_mult=[1] * (downsamples + 1), num_res_blocks=1,
        temperal_downsample=[False] + [True] * (downsamples - 1),
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 2.0, 1.2]).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
        time_shift_type="exponential")
    return dict(transformer=transformer, vae=vae, scheduler=scheduler,
                text_encoder=_qwen_encoder(qwen_tokenizer(), text_seed),
                tokenizer=qwen_tokenizer())


def save_qwenimage(folder: Path, seed: int = 0, text_seed: int = 100) -> Path:
    """QwenImagePipeline: Qwen2.5-VL (width 16), an MMDiT on packed 4x4x4 latents, an
    8 x VAE."""
    from diffusers import QwenImagePipeline

    QwenImagePipeline(**_qwen_parts(seed, text_seed, 3)).save_pretrained(folder)
    return folder


def qwen_processor():
    """Qwen2.5-VL's processor of a source image and its prompt (Qwen2-VL's image
    processor, resizing to at most 112 x 112 pixels: a few vision tokens)."""
    from transformers import Qwen2VLImageProcessorPil

    from digenrl.models.qwen_processor import ImageTextProcessor

    return ImageTextProcessor(Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112),
                              qwen_tokenizer())


def save_qwenimage_edit(folder: Path, seed: int = 0, text_seed: int = 100) -> Path:
    """QwenImageEditPipeline: QwenImagePipeline's parts with a 16 x VAE (a source image
    of about a megapixel is 32 x 32 tokens) and the processor."""
    from diffusers import QwenImageEditPipeline

    import json

    QwenImageEditPipeline(processor=qwen_processor(),
                          **_qwen_parts(seed, text_seed, 4)).save_pretrained(folder)
    # The processor was saved from ImageTextProcessor (Qwen2VLProcessor without the video
    # processor, which needs torchvision); the folder names transformers' class, as a
    # Qwen-Image-Edit folder does.
    index = folder / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()),
                                 "processor": ["transformers", "Qwen2VLProcessor"]}, indent=2))
    return folder


def save_hunyuanvideo(folder: Path, seed: int = 0, text_seed: int = 100) -> Path:
    """HunyuanVideoPipeline: a Llama encoder (width 16, three layers: the pipeline takes
    the first one's hidden states) and CLIP-L (pooled, width 8, 77 positions), a
    guidance-embedding 3D transformer on 4-channel latents, the HunyuanVideo VAE (8 x
    spatial, 4 x temporal), the scheduler's shift 7."""
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideoPipeline, HunyuanVideoTransformer3DModel)
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8,
        rope_axes_dim=(2, 2, 4))
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
        layers_per_block=1, norm_num_groups=4, scaling_factor=0.476986,
        spatial_compression_ratio=8, temporal_compression_ratio=4).eval()
    tok = llama_tokenizer()
    torch.manual_seed(text_seed)
    llama = LlamaModel(LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    clip = clip_tokenizer(max_length=77)
    pipe = HunyuanVideoPipeline(
        text_encoder=llama, tokenizer=tok, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=clip_encoder(clip, 8, text_seed + 1, projection=False),
        tokenizer_2=clip)
    pipe.save_pretrained(folder)
    return folder


def save_kontext(folder: Path, seed: int = 0, text_seed: int = 100) -> Path:
    """FluxKontextPipeline: FluxPipeline's parts with a 16 x VAE (a source image of about
    a megapixel is 32 x 32 tokens)."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler,
                           FluxKontextPipeline, FluxTransformer2DModel)

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=8, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(in_channels=3, out_channels=3,
                        down_block_types=("DownEncoderBlock2D",) * 5,
                        up_block_types=("UpDecoderBlock2D",) * 5, block_out_channels=(4,) * 5,
                        layers_per_block=1, latent_channels=4, norm_num_groups=2,
                        sample_size=EDIT_SIZE, scaling_factor=0.3611, shift_factor=0.1159).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)
    tok = clip_tokenizer()
    pipe = FluxKontextPipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=clip_encoder(tok, 8, text_seed, projection=False), tokenizer=tok,
        text_encoder_2=t5_encoder(t5_tokenizer(), 32, text_seed + 2),
        tokenizer_2=t5_tokenizer())
    pipe.save_pretrained(folder)
    return folder


SAVERS = {"sd3": save_sd3, "flux": save_flux, "wan": save_wan, "qwenimage": save_qwenimage,
          "hunyuanvideo": save_hunyuanvideo, "qwenimage_edit": save_qwenimage_edit,
          "kontext": save_kontext}

#: Model settings a run on each tiny pipeline needs (the pipelines' defaults are
#: full-size images).
MODEL_SETTINGS = {
    "sd3": {"max_sequence_length": MAX_SEQUENCE_LENGTH},
    "flux": {"max_sequence_length": MAX_SEQUENCE_LENGTH, "height": SIZE, "width": SIZE},
    "wan": {"max_sequence_length": MAX_SEQUENCE_LENGTH, "height": SIZE, "width": SIZE,
            "num_frames": FRAMES},
    "qwenimage": {"max_sequence_length": MAX_SEQUENCE_LENGTH, "height": SIZE, "width": SIZE},
    "hunyuanvideo": {"max_sequence_length": MAX_SEQUENCE_LENGTH, "height": SIZE,
                     "width": SIZE, "num_frames": FRAMES},
    "qwenimage_edit": {"height": EDIT_SIZE, "width": EDIT_SIZE},
    "kontext": {"max_sequence_length": MAX_SEQUENCE_LENGTH, "height": EDIT_SIZE,
                "width": EDIT_SIZE},
}
