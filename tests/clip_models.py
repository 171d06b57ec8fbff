"""Tiny CLIP reward models, built from the real transformers classes with small configs
and seeded random weights, saved as a real one is laid out: the CLIPModel with
``save_pretrained``, its tokenizer (the byte-level CLIPTokenizer of digenrl/testing/pipelines.py)
and CLIPImageProcessor beside it; and aesthetic heads in LAION's layout."""

from __future__ import annotations

from pathlib import Path

import torch

from digenrl.testing.pipelines import clip_tokenizer

#: Width of the tiny model's image and prompt embeddings (its projection_dim).
PROJECTION = 16
#: Pixels the tiny model's processor resizes and crops images to.
IMAGE_SIZE = 32


def save_tiny_clip(folder: Path, seed: int = 0) -> Path:
    """A tiny CLIPModel, its tokenizer and image processor, saved in ``folder``."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    tokenizer = clip_tokenizer(max_length=16)
    config = CLIPConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2,
                     "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 1,
                     "pad_token_id": 1},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": IMAGE_SIZE, "patch_size": 8},
        projection_dim=PROJECTION)
    torch.manual_seed(seed)
    CLIPModel(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                       crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(folder)
    return folder


def aesthetic_head_state(width: int = PROJECTION, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights in the layout of LAION's improved aesthetic predictor:
    Linear(width, 1024), Dropout, Linear(1024, 128), Dropout, Linear(128, 64), Dropout,
    Linear(64, 16), Linear(16, 1)."""
    torch.manual_seed(seed)
    layers = torch.nn.Sequential(
        torch.nn.Linear(width, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
        torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))
    return {f"layers.{k}": v for k, v in layers.state_dict().items()}
