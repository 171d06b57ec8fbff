"""FLUX.1 Kontext (``FluxKontextPipeline``): instruction editing on FLUX.1. The source
image is resized to the Kontext resolution nearest its aspect ratio (about 1 megapixel;
or to about ``model.source_area`` pixels at its aspect ratio), encoded by the VAE (the
latent distribution's mode, scaled and shifted) and packed 2 x 2;
its tokens are appended after the image's, with position ids whose first axis is 1, and
the transformer's output for them is dropped. The prompts are encoded as FLUX.1 encodes
them (CLIP-L pooled, T5), without the image; guidance is the guidance embedding.

Without a source image it samples as FluxPipeline does (the pipeline's ``image=None``).
"""

from __future__ import annotations

from functools import cached_property

import torch
from diffusers.image_processor import VaeImageProcessor

from digenrl.models.base import SourceImage
from digenrl.models.common import by_source_size, scaled_vae_encode
from digenrl.models.flux import FluxFamily, flux_velocity, image_ids

__all__ = ["FluxKontextFamily"]


class FluxKontextFamily(FluxFamily):
    pipeline_class = "FluxKontextPipeline"
    takes_images = True
    max_source_images = 1

    @cached_property
    def image_processor(self) -> VaeImageProcessor:
        """The pipeline's own image processor (resizing to a multiple of the packed
        latent patch, PIL's Lanczos, pixels to [-1, 1])."""
        return VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    def pipeline_source_size(self, image: SourceImage) -> tuple[int, int]:
        """(height, width) the pipeline resizes a source image to: the Kontext
        resolution nearest its aspect ratio, on the packed latent grid."""
        from diffusers.pipelines.flux.pipeline_flux_kontext import \
            PREFERRED_KONTEXT_RESOLUTIONS

        h, w = self.image_processor.get_default_height_width(image.pil())
        if not h or not w:
            raise ValueError(f"source image: expected at least {self.size_multiple()} x "
                             f"{self.size_multiple()} pixels, got {image.pixels.shape[:2]}")
        _, width, height = min((abs(w / h - rw / rh), rw, rh)
                               for rw, rh in PREFERRED_KONTEXT_RESOLUTIONS)
        m = self.size_multiple()
        return height // m * m, width // m * m

    def source_pixels(self, image: SourceImage) -> torch.Tensor:
        """The source image as the pipeline feeds the VAE: ``(1, 3, H, W)`` in [-1, 1]."""
        h, w = self.source_size(image)
        resized = self.image_processor.resize(image.pil(), h, w)
        return self.image_processor.preprocess(resized, h, w)

    def source_latents(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """The pipeline's encoding: the latent distribution's mode, shifted and scaled."""
        return scaled_vae_encode(vae, pixels)

    def predict_velocity(self, transformer, x, sigma, cond, guidance_scale):
        if "source_tokens" not in cond.tensors:
            return super().predict_velocity(transformer, x, sigma, cond, guidance_scale)

        def velocity(x, cond, size):
            ids = image_ids(2 * size[0], 2 * size[1], x.device, first=1)
            return flux_velocity(transformer, x, self.timestep(sigma), cond, guidance_scale,
                                 cond.tensors["source_tokens"], ids)

        return by_source_size(x, cond.to_dtype(x.dtype), velocity)
