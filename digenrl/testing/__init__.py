"""What tests and benchmarks build for themselves, without downloading anything:
random-weight pipeline folders of every supported family, from the real diffusers and
transformers classes with small configs and tokenizers made locally
(:mod:`digenrl.testing.pipelines`)."""
