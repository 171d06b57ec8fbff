"""Tiny pipelines of each supported family, built from the real diffusers and
transformers classes with small configs and random weights, saved with the pipeline's
own ``save_pretrained``.

Tokenizers are made here too: a byte-level BPE vocabulary in CLIPTokenizer's form (the
256 byte symbols, with and without the end-of-word mark, and a few merges) and a
SentencePiece unigram model trained on the built-in prompts for T5 / UMT5 (so a prompt
with characters it never saw, e.g. Japanese, has unknown tokens).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

#: Sequence length of the T5 / UMT5 encodings in these pipelines (model.max_sequence_length).
MAX_SEQUENCE_LENGTH = 16
#: Image (and video frame) size in pixels, and frames of a video.
SIZE, FRAMES = 32, 5

_TOKENIZERS: dict[str, object] = {}


def _corpus() -> list[str]:
    from digenrl.prompts import PROMPT_SETS

    words = [p for prompts in PROMPT_SETS.values() for p in prompts]
    return words + ["a red fox in the snow", "a blue bird on a branch", "an astronaut",
                    "a photo of a cat", "a dog running in the park", "blurry, low quality"]


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


def _clip_encoder(tokenizer, hidden: int, seed: int, projection: bool = True):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                            intermediate_size=2 * hidden, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=tokenizer.model_max_length,
                            projection_dim=hidden, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls(config).eval()


def _t5_encoder(tokenizer, d_model: int, seed: int, umt5: bool = False):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    kw = dict(vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=2 * d_model,
              num_layers=1, num_heads=2, relative_attention_num_buckets=8,
              pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    if umt5:
        return UMT5EncoderModel(UMT5Config(**kw)).eval()
    return T5EncoderModel(T5Config(**kw)).eval()


def _vae(seed: int, **kw):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3,
                         down_block_types=("DownEncoderBlock2D",) * 3,
                         up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 8, 8),
                         layers_per_block=1, latent_channels=4, norm_num_groups=8,
                         sample_size=SIZE, **kw).eval()


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
        text_encoder=_clip_encoder(tok, 8, text_seed), tokenizer=tok,
        text_encoder_2=_clip_encoder(tok, 8, text_seed + 1), tokenizer_2=clip_tokenizer(),
        text_encoder_3=_t5_encoder(t5_tokenizer(), 32, text_seed + 2),
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
        text_encoder=_clip_encoder(tok, 8, text_seed, projection=False), tokenizer=tok,
        text_encoder_2=_t5_encoder(t5_tokenizer(), 32, text_seed + 2),
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
        tokenizer=t5_tokenizer(), text_encoder=_t5_encoder(t5_tokenizer(), 32, text_seed,
                                                           umt5=True),
        vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer)
    pipe.save_pretrained(folder)
    return folder


SAVERS = {"sd3": save_sd3, "flux": save_flux, "wan": save_wan}

#: Model settings a run on each tiny pipeline needs (the pipelines' defaults are
#: full-size images).
MODEL_SETTINGS = {
    "sd3": {"max_sequence_length": MAX_SEQUENCE_LENGTH},
    "flux": {"max_sequence_length": MAX_SEQUENCE_LENGTH, "height": SIZE, "width": SIZE},
    "wan": {"max_sequence_length": MAX_SEQUENCE_LENGTH, "height": SIZE, "width": SIZE,
            "num_frames": FRAMES},
}
