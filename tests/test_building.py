"""Models built in two threads of one process at once, as a worker's GPU task and the task
beside it may build them (a trainer's policy beside an encode task it was lent, a reward
model beside the VAE): each comes out as it does alone. (A LoRA run's workers each build
the frozen base weights; a base built differently on one worker changes its results.)"""

import threading

import torch

from digenrl.models import build_transformer, build_vae
from digenrl.models.parts import load_part

from conftest import pipeline_config, small_config

ROUNDS = 4


def same(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """The names of the tensors in which ``a`` differs from ``b`` (or is on meta)."""
    sb = b.state_dict()
    return [k for k, t in a.state_dict().items() if t.is_meta or not torch.equal(t, sb[k])]


def test_models_built_while_another_thread_loads_one_are_those_built_alone(tiny_pipelines):
    folder = tiny_pipelines["sd3"]
    folder_model = pipeline_config(folder, "sd3").model  # diffusers' from_pretrained
    tiny = small_config().model  # the tiny model: built by its constructor, seeded
    encoder_alone = load_part(folder, "text_encoder")  # transformers' from_pretrained
    tiny_alone, vae_alone = build_transformer(tiny, 0), build_vae(tiny, 0)
    loaded, vaes, errors = [], [], []

    def load_transformers():  # and the tiny model's VAE, seeded like its transformer
        try:
            for _ in range(ROUNDS):
                loaded.append(build_transformer(folder_model, 0))
                vaes.append(build_vae(tiny, 0))
        except Exception as e:  # reported below
            errors.append(e)

    loader = threading.Thread(target=load_transformers)
    loader.start()
    try:
        encoders = [load_part(folder, "text_encoder") for _ in range(ROUNDS)]
        tinies = [build_transformer(tiny, 0) for _ in range(ROUNDS)]
    finally:
        loader.join()
    assert not errors, errors
    assert loaded and not any(p.is_meta for m in loaded for p in m.parameters())
    for built, alone in [*((e, encoder_alone) for e in encoders),
                         *((t, tiny_alone) for t in tinies), *((v, vae_alone) for v in vaes)]:
        differ = same(built, alone)
        assert not differ, differ[:5]
