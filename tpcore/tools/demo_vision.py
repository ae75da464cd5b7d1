"""Demo: a CLIP model split over 2 CPU ranks (gloo), image-text similarities beside the unsplit model's.

Run with ``nox -s demo_vision`` (or ``python -m tpcore.tools.demo_vision`` with tpcore and tp-vision
installed). No PyPI package ships vision weights, so the model is random-init (seeded) at a small
ViT-S/32-like size: the similarities mean nothing, but the split model must give the same ones.
The vision tower (6 heads) and the text tower (4 heads) are split by heads, each by its own count.
Prints both similarity matrices, the largest difference of the embeddings and each rank's
parameter memory against the whole model's.
"""

from __future__ import annotations

import argparse

import torch

from tpcore.tools.demo import run_split

PICTURES = ("stripes", "checkerboard", "gradient", "disc")


def pictures(size: int) -> torch.Tensor:
    """Four synthetic RGB images ``(4, 3, size, size)``, in the range CLIP's processor normalizes to."""
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
    gray = [
        torch.sin(12 * xs),
        torch.sign(torch.sin(8 * xs) * torch.sin(8 * ys)),
        (xs + ys) / 2,
        (xs**2 + ys**2 < 0.4).float() * 2 - 1,
    ]
    tints = torch.tensor([[1.0, 0.6, 0.2], [0.3, 1.0, 0.5], [0.5, 0.4, 1.0], [1.0, 1.0, 0.3]])
    return torch.stack([tint[:, None, None] * image for tint, image in zip(tints, gray, strict=True)]) * 1.5


def clip_model(seed: int = 0):
    from transformers import CLIPConfig, CLIPModel

    text = {"hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 4, "intermediate_size": 1024}
    vision = {"hidden_size": 384, "num_attention_heads": 6, "num_hidden_layers": 6, "intermediate_size": 1536}
    vision |= {"image_size": 224, "patch_size": 32}
    torch.manual_seed(seed)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=256)).eval()


def similarities(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits_per_image [images, captions], image_embeds, text_embeds)``."""
    with torch.inference_mode():
        out = model(**batch)
    return out.logits_per_image, out.image_embeds, out.text_embeds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks to split the model over (default 2)")
    args = parser.parse_args(argv)

    model = clip_model()
    captions = torch.randint(1, 1000, (len(PICTURES), 6), generator=torch.Generator().manual_seed(1))
    batch = {"pixel_values": pictures(224), "input_ids": captions}
    reference = similarities(model, batch)
    measured = run_split(model, args.ranks, lambda split_model: similarities(split_model, batch))
    split = measured.result

    print(
        f"CLIP (random-init; vision: 6 layers, 6 heads; text: 4 layers, 4 heads) split over {args.ranks} CPU "
        f"ranks with gloo (ready in {measured.ready_s:.1f} s)\n"
    )
    width = max(map(len, PICTURES))
    print(f"image-text logits    {'split':^{9 * len(PICTURES)}}   {'unsplit':^{9 * len(PICTURES)}}")
    for name, split_row, whole_row in zip(PICTURES, split[0], reference[0], strict=True):
        cells = "".join(f"{value:9.4f}" for value in split_row), "".join(f"{value:9.4f}" for value in whole_row)
        print(f"  {name:<{width}}      {cells[0]}   {cells[1]}")
    difference = max((a - b).abs().max().item() for a, b in zip(split, reference, strict=True))
    print(f"\nmax abs difference of the logits and embeddings, split vs unsplit: {difference:.2e}")
    measured.print_memory(
        "  (attention and MLP weights of both towers are split, the text tower's token embedding over the\n"
        "   vocabulary; the patch embedding, position embeddings, layer norms and projections are replicated)"
    )


if __name__ == "__main__":
    main()
