"""The Qwen-Image-Edit folder's ``processor/`` for images and text, in a module of its
own: importing transformers' Qwen2VLProcessor costs seconds, which only a worker that
encodes an edit's prompts with its source images pays."""

from __future__ import annotations

from transformers import Qwen2VLProcessor

__all__ = ["ImageTextProcessor"]


class ImageTextProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor for images and text only: transformers builds its video
    processor only with torchvision installed, and a prompt with its source image needs
    none. Loads a Qwen-Image-Edit folder's ``processor/`` (its image processor is the
    PIL one without torchvision) and turns each prompt's image placeholder into the
    image's vision tokens as Qwen2VLProcessor does."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template,
                         **kwargs)
