"""The LLaVA model against transformers: logits, image features, preprocessing, loading, hashes.

The reference is transformers' own ``LlavaForConditionalGeneration`` and ``CLIPImageProcessor``
loaded from the very folder radixserve loads (the seeded ``tiny-random-llava`` written by
``radixserve.model.testing.tiny_llava``), so the folder's layout is checked as well as the numerics.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil

import pytest
import torch
from PIL import Image

from radixserve.memory.kv_pool import KVPool
from radixserve.model.arch.attention import make_attention_backend
from radixserve.model.load_error import ModelLoadError
from radixserve.model.arch.factory import create_vlm
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.model.vision.image_processor import decode_image, image_content_hash, preprocess
from radixserve.model.arch.llava import expand_image_tokens
from radixserve.model.loaders.llava_hf import split_weights
from radixserve.model.registry import load_model, load_tokenizer
from radixserve.model.testing.tiny_llava import write_tiny_llava
from radixserve.model.vision.vlm_config import ImageProcessorConfig

transformers = pytest.importorskip("transformers")

ATOL = 1e-4


def _image(h: int, w: int, seed: int, mode: str = "RGB") -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}[mode]
    arr = torch.randint(0, 256, (h, w, channels), generator=g, dtype=torch.uint8).numpy()
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode=mode)


def _processor_cls(name: str):
    """transformers' Pillow image processor ``name`` (``CLIPImageProcessor``'s Pillow backend
    under its own name where transformers has one; torchvision is not installed)."""
    return getattr(transformers, name + "Pil", None) or getattr(transformers, name)


def _hf_processor(path):
    return _processor_cls("CLIPImageProcessor").from_pretrained(str(path))


def _hf_model(path):
    from transformers import LlavaForConditionalGeneration

    model, info = LlavaForConditionalGeneration.from_pretrained(
        str(path), output_loading_info=True, attn_implementation="eager", dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


class Tiny:
    """Our VLM and transformers' on one folder."""

    def __init__(self, path):
        self.path = path
        self.loaded = load_model(str(path), dtype=torch.float32)
        v = self.loaded.vision
        assert v is not None
        self.vision = v
        self.model = create_vlm(self.loaded.config, self.loaded.state_dict, v)
        self.ref = _hf_model(path)
        self.proc = _hf_processor(path)
        self.image_id = v.config.image_token_id
        self.attn = make_attention_backend("torch")

    def pool(self, capacity: int = 512) -> KVPool:
        c = self.loaded.config
        return KVPool(c.num_layers, capacity, c.num_kv_heads, c.head_dim)

    def prompt(self, text: str) -> list[int]:
        ids = self.loaded.tokenizer.encode(text)
        return expand_image_tokens(ids, self.image_id, self.vision.config.tokens_per_image)

    @torch.inference_mode()
    def ref_logits(self, ids: list[int], images: list[Image.Image]) -> torch.Tensor:
        kw = {}
        if images:
            kw["pixel_values"] = self.proc(images=images, return_tensors="pt")["pixel_values"]
        return self.ref(input_ids=torch.tensor([ids]), **kw).logits[0].float()

    def logits(self, ids: list[int], images: list[Image.Image]) -> torch.Tensor:
        feats = self.model.encode_images(preprocess(images, self.vision.processor)) if images else None
        batch = ForwardBatch.build([ids], [0], [torch.arange(len(ids))], return_all_logits=[True])
        out = self.model(batch, self.pool(), self.attn, image_features=feats)
        return out.all_logits[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return Tiny(write_tiny_llava(tmp_path_factory.mktemp("tiny-llava")))


# --------------------------------------------------------------------------- logits
def test_one_image_logits_match_transformers(tiny: Tiny) -> None:
    img = _image(41, 57, seed=1)
    ids = tiny.prompt("<|im_start|>user\n<image>\nWhat is in the picture?<|im_end|>\n")
    assert ids.count(tiny.image_id) == tiny.vision.config.tokens_per_image == 25
    ours, ref = tiny.logits(ids, [img]), tiny.ref_logits(ids, [img])
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_several_images_logits_match_transformers(tiny: Tiny) -> None:
    """Three images of different sizes and modes (RGBA composited on white, grayscale) in
    one prompt, one of them right at the start."""
    imgs = [_image(30, 30, 2), _image(64, 33, 3, "RGBA"), _image(50, 90, 4, "L")]
    ids = tiny.prompt("<image>first, then <image> and <image>: which differ?")
    ours, ref = tiny.logits(ids, imgs), tiny.ref_logits(ids, imgs)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    # The images matter: swapping two changes the logits.
    swapped = tiny.logits(ids, [imgs[1], imgs[0], imgs[2]])
    assert (swapped - ours).abs().max() > 1e-2


def test_image_features_match_transformers(tiny: Tiny) -> None:
    imgs = [_image(40, 40, 5), _image(35, 80, 6)]
    pv = tiny.proc(images=imgs, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        ref = torch.stack(list(tiny.ref.model.get_image_features(pixel_values=pv).pooler_output))
    ours = tiny.model.encode_images(preprocess(imgs, tiny.vision.processor))
    assert ours.shape == (2, 25, tiny.loaded.config.hidden_size)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_ragged_batch_and_prefix_split_inside_an_image(tiny: Tiny) -> None:
    """Two sequences in one ragged batch (features in batch order), and a prompt run as a
    cached prefix that ends inside an image plus the rest: the same logits as one pass."""
    a_imgs, b_imgs = [_image(33, 47, 7)], [_image(60, 31, 8), _image(31, 31, 9)]
    a = tiny.prompt("Look: <image> now answer.")
    b = tiny.prompt("<image><image> compare them")
    fa = tiny.model.encode_images(preprocess(a_imgs, tiny.vision.processor))
    fb = tiny.model.encode_images(preprocess(b_imgs, tiny.vision.processor))
    pool = tiny.pool()
    batch = ForwardBatch.build([a, b], [0, 0], [torch.arange(len(a)), len(a) + torch.arange(len(b))],
                               return_all_logits=[True, True])
    out = tiny.model(batch, pool, tiny.attn, image_features=torch.cat([fa, fb]))
    torch.testing.assert_close(out.all_logits[0], tiny.ref_logits(a, a_imgs), atol=ATOL, rtol=0)
    torch.testing.assert_close(out.all_logits[1], tiny.ref_logits(b, b_imgs), atol=ATOL, rtol=0)

    split = b.index(tiny.image_id) + 10  # 10 rows into the first image
    rows = fb.reshape(-1, fb.shape[-1])
    pool = tiny.pool()
    slots = torch.arange(len(b))
    head = ForwardBatch.build([b[:split]], [0], [slots[:split]])
    tiny.model(head, pool, tiny.attn, image_features=rows[:10])
    tail = ForwardBatch.build([b[split:]], [split], [slots], return_all_logits=[True])
    got = tiny.model(tail, pool, tiny.attn, image_features=rows[10:]).all_logits[0]
    torch.testing.assert_close(got, out.all_logits[1][split:], atol=ATOL, rtol=0)


def test_text_only_prompt_is_the_text_model(tiny: Tiny) -> None:
    """Without images the VLM is its decoder, and input_embeds equal to the embedding lookup
    give the same logits as input ids, bit for bit."""
    ids = tiny.prompt("No picture here, just text.")
    ours = tiny.logits(ids, [])
    torch.testing.assert_close(ours, tiny.ref_logits(ids, []), atol=ATOL, rtol=0)
    lm = tiny.model.language_model
    batch = ForwardBatch.build([ids], [0], [torch.arange(len(ids))], return_all_logits=[True])
    plain = lm(batch, tiny.pool(), tiny.attn).all_logits[0]
    embeds = torch.nn.functional.embedding(batch.input_ids, lm.embed_weight).float()
    via_embeds = lm(dataclasses.replace(batch, input_embeds=embeds), tiny.pool(), tiny.attn).all_logits[0]
    assert torch.equal(plain, ours) and torch.equal(plain, via_embeds)


def test_placeholder_and_feature_counts_must_agree(tiny: Tiny) -> None:
    ids = tiny.prompt("<image> one image")
    feats = tiny.model.encode_images(preprocess([_image(30, 30, 1)] * 2, tiny.vision.processor))
    batch = ForwardBatch.build([ids], [0], [torch.arange(len(ids))])
    with pytest.raises(ValueError, match="25 image placeholder tokens but 50"):
        tiny.model(batch, tiny.pool(), tiny.attn, image_features=feats)
    with pytest.raises(ValueError, match="but 0 image feature rows"):
        tiny.model(batch, tiny.pool(), tiny.attn)
    bad = ForwardBatch.build([ids], [0], [torch.arange(len(ids))])
    bad.input_embeds = torch.zeros(len(ids), 3)
    with pytest.raises(ValueError, match="input_embeds must be"):
        tiny.model.language_model(bad, tiny.pool(), tiny.attn)


@pytest.mark.parametrize("feature_layer,select", [([0, -2], "default"), (-1, "full")])
def test_feature_layers_and_select_strategy(tmp_path, feature_layer, select) -> None:
    """Several feature layers (concatenated; 0 is the embeddings) and the "full" strategy
    (CLS kept) against transformers."""
    path = write_tiny_llava(tmp_path / "m", seed=3, feature_layer=feature_layer, select=select)
    t = Tiny(path)
    assert t.vision.config.tokens_per_image == (26 if select == "full" else 25)
    imgs = [_image(45, 38, 10)]
    ids = t.prompt("Describe <image> briefly.")
    torch.testing.assert_close(t.logits(ids, imgs), t.ref_logits(ids, imgs), atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- loading
def test_transformers_saved_layouts_load_the_same(tiny: Tiny, tmp_path) -> None:
    """What transformers v5 saves (vision_tower.* without vision_model) and its module names
    (model.language_model.*, model.vision_tower.*) split into the same tensors as the Hub
    layout of the tiny folder."""
    tiny.ref.save_pretrained(str(tmp_path / "v5"))
    shutil.copy(tiny.path / "preprocessor_config.json", tmp_path / "v5")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny.path / f, tmp_path / "v5")
    again = load_model(str(tmp_path / "v5"))
    assert again.config == tiny.loaded.config and again.vision.config == tiny.vision.config
    for ours, theirs in ((tiny.loaded.state_dict, again.state_dict),
                         (tiny.vision.state_dict, again.vision.state_dict)):
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    text, vision = split_weights(dict(tiny.ref.state_dict()), "mem")
    assert vision.keys() == tiny.vision.state_dict.keys()
    assert text.keys() == tiny.loaded.state_dict.keys()


def test_bad_folders_name_the_problem(tiny: Tiny, tmp_path) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny.path, d)
    (d / "preprocessor_config.json").unlink()
    with pytest.raises(ModelLoadError, match="preprocessor_config.json"):
        load_model(str(d))
    shutil.copy(tiny.path / "preprocessor_config.json", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["vision_config"]["model_type"] = "siglip_vision_model"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="siglip_vision_model"):
        load_model(str(d))
    cfg["vision_config"]["model_type"] = "clip_vision_model"
    cfg["vision_feature_layer"] = -9
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="vision_feature_layer"):
        load_model(str(d))
    cfg["vision_feature_layer"], cfg["image_seq_length"] = -2, 576
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="image_seq_length is 576.*25 tokens per image"):
        load_model(str(d))
    with pytest.raises(ModelLoadError, match="unexpected tensor 'extra.weight'"):
        split_weights({"extra.weight": torch.zeros(1)}, "mem")
    sd = dict(tiny.vision.state_dict)
    del sd["multi_modal_projector.linear_2.bias"]
    with pytest.raises(ValueError, match="multi_modal_projector.linear_2.bias"):
        create_vlm(tiny.loaded.config, tiny.loaded.state_dict, dataclasses.replace(tiny.vision, state_dict=sd))


def test_tiny_random_llava_alias(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    m = load_model("tiny-random-llava")
    assert m.name == "tiny-random-llava" and m.vision is not None
    assert (tmp_path / "radixserve" / "models" / "tiny-random-llava-v1" / "model.safetensors").is_file()
    tok = load_tokenizer("tiny-random-llava")
    assert tok.encode("a <image> b").count(m.vision.config.image_token_id) == 1
    again = load_model("tiny-random-llava")  # from the cache folder, the same weights
    assert all(torch.equal(again.state_dict[k], v) for k, v in m.state_dict.items())


# --------------------------------------------------------------------------- preprocessing
@pytest.mark.parametrize("size", [(41, 57), (64, 33), (30, 30), (12, 200), (300, 301)])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA"])
def test_preprocess_equals_clip_image_processor(tiny: Tiny, size, mode) -> None:
    img = _image(*size, seed=size[0] * 7 + size[1], mode=mode)
    ours = preprocess([img], tiny.vision.processor)
    ref = tiny.proc(images=[img], return_tensors="pt")["pixel_values"]
    assert torch.equal(ours, ref)


def test_preprocess_palette_with_transparency(tiny: Tiny) -> None:
    img = _image(40, 52, 11).convert("P")
    img.info["transparency"] = 3
    ref = tiny.proc(images=[img], return_tensors="pt")["pixel_values"]
    assert torch.equal(preprocess([img], tiny.vision.processor), ref)


@pytest.mark.parametrize("d", [
    {"size": {"shortest_edge": 24}, "crop_size": {"height": 30, "width": 30}},  # crop pads
    {"size": {"height": 28, "width": 36}, "crop_size": {"height": 20, "width": 26}, "resample": 2},
    {"size": 33, "crop_size": 30, "do_normalize": False},  # the old int forms
    {"size": {"shortest_edge": 30}, "do_center_crop": False, "do_rescale": False,
     "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
])
def test_preprocess_configs_equal_clip_image_processor(d) -> None:
    ours_cfg = ImageProcessorConfig.from_hf(d)
    ref = _processor_cls("CLIPImageProcessor")(**d)
    for img in (_image(45, 61, 1), _image(70, 30, 2, "RGBA")):
        want = ref(images=[img], return_tensors="pt")["pixel_values"]
        assert torch.equal(preprocess([img], ours_cfg), want), d


def test_preprocess_llava_pad_to_square() -> None:
    d = {"size": {"shortest_edge": 30}, "crop_size": {"height": 30, "width": 30}, "do_pad": True}
    ref = _processor_cls("LlavaImageProcessor")(**d)
    for img in (_image(45, 61, 1), _image(70, 30, 2), _image(31, 31, 3)):
        want = ref(images=[img], return_tensors="pt")["pixel_values"]
        assert torch.equal(preprocess([img], ImageProcessorConfig.from_hf(d)), want)


def test_processor_config_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="image_std"):
        ImageProcessorConfig.from_hf({"image_std": [1.0, 0.0, 1.0]})
    with pytest.raises(ValueError, match="resample"):
        ImageProcessorConfig.from_hf({"resample": 9})
    with pytest.raises(ValueError, match="longest_edge"):
        ImageProcessorConfig.from_hf({"size": {"shortest_edge": 30, "longest_edge": 60}})


# --------------------------------------------------------------------------- content hash
def _png(img: Image.Image, level: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=level)
    return buf.getvalue()


def test_hash_same_pixels_other_encoding_equal(tiny: Tiny) -> None:
    cfg = tiny.vision.processor
    img = _image(48, 64, 12)
    fast, small = _png(img, 0), _png(img, 9)
    assert fast != small
    h = image_content_hash(decode_image(fast), cfg)
    assert h == image_content_hash(decode_image(small), cfg) == image_content_hash(img, cfg)
    buf = io.BytesIO()
    img.save(buf, format="BMP")
    assert image_content_hash(decode_image(buf.getvalue()), cfg) == h
    assert len(h) == 64 and int(h, 16) >= 0  # hex sha256


def test_hash_one_pixel_or_config_differs(tiny: Tiny) -> None:
    cfg = tiny.vision.processor
    img = _image(48, 64, 12)
    other = img.copy()
    r, g, b = other.getpixel((5, 7))
    other.putpixel((5, 7), ((r + 1) % 256, g, b))
    h = image_content_hash(img, cfg)
    assert image_content_hash(other, cfg) != h
    assert image_content_hash(decode_image(_png(other, 6)), cfg) != h
    assert image_content_hash(img, dataclasses.replace(cfg, crop_size=(28, 28))) != h
    # Same bytes, another shape: the size is part of the hash.
    flat = Image.frombytes("RGB", (64 * 48, 1), img.tobytes())
    assert image_content_hash(flat, cfg) != h


def test_decode_image_rejects_garbage_and_huge() -> None:
    with pytest.raises(ValueError, match="cannot be decoded"):
        decode_image(b"not an image at all")
    with pytest.raises(ValueError, match="cannot be decoded"):
        decode_image(_png(_image(20, 20, 1), 6)[:60])
    with pytest.raises(ValueError, match="more than the limit"):
        decode_image(_png(_image(20, 20, 1), 6), max_pixels=100)


def test_bfloat16_model_stays_close(tiny: Tiny) -> None:
    """The bfloat16 VLM (tower, projector and decoder in bfloat16; float32 logits) stays near
    the float32 reference: a smoke test of the dtype paths, not an exactness claim."""
    m = load_model(str(tiny.path), dtype=torch.bfloat16)
    vlm = create_vlm(m.config, m.state_dict, m.vision, dtype=torch.bfloat16)
    imgs = [_image(41, 57, 1), _image(30, 44, 2)]
    ids = tiny.prompt("Look <image> and <image> here")
    feats = vlm.encode_images(preprocess(imgs, m.vision.processor))
    c = m.config
    pool = KVPool(c.num_layers, 256, c.num_kv_heads, c.head_dim, dtype=torch.bfloat16)
    batch = ForwardBatch.build([ids], [0], [torch.arange(len(ids))], return_all_logits=[True])
    out = vlm(batch, pool, tiny.attn, image_features=feats).all_logits[0]
    ref = tiny.ref_logits(ids, imgs)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
