"""Random InternVL checkpoints in the original ``InternVLChatModel`` layout, for the tests (a
test-only module, so it lives here, not in the package): an HF-native random checkpoint
(``vlmbatch/models/internvl/random.py``) written out by the inverse of the key map
``vlmbatch/models/internvl/original.py`` reads (transformers' conversion script's, run
backwards), so the two hold the same model and the HF-native one has transformers as its
reference.

- ``save_original(hf, out, template=..., arch=...)``: ``hf``'s weights under the original
  names (vision ``attn.qkv`` fused, ``ls1``/``ls2``, ``mlp1.{0,1,3}``, ``language_model.
  model.*``; for ``InternLM2ForCausalLM`` from a Llama text model: ``tok_embeddings``, the
  grouped ``wqkv`` (per kv head its query heads, then k, then v), ``wo``, ``w1/w2/w3``,
  ``attention_norm``, ``ffn_norm``, ``output``), an ``InternVLChatConfig``-style config.json
  (``llm_config``, ``template``, ``ps_version``, the tiling fields), the tokenizer files.
- ``save_sentencepiece_tokenizer(path)``: an InternLM2-style tokenizer (a SentencePiece
  ``tokenizer.model`` trained here on a few sentences, ``<|im_start|>``/``<|im_end|>`` over
  reserved pieces of its vocabulary, the image tokens added after it, tokenizer_config.json
  naming the remote-code ``InternLM2Tokenizer`` as the releases do).

Nothing is downloaded.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import sentencepiece as spm
import torch
from safetensors.torch import load_file, save_file

from vlmbatch.models.internvl.family import INTERNVL
from vlmbatch.models.internvl.random import CORPUS
from vlmbatch.models.tokenizer import SentencePieceTokenizer

# normalised HF-native vision/projector name pieces -> the original's (original._VISION
# backwards), and our decoder names -> InternLM2's (original._INTERNLM2 backwards)
_VISION = [("vision_tower.", "vision_model."), ("encoder.layer.", "encoder.layers."),
           ("cls_token", "class_embedding"), ("position_embeddings", "position_embedding"),
           ("patch_embeddings.projection", "patch_embedding"), ("lambda_1", "ls1"),
           ("lambda_2", "ls2"), ("attention.projection_layer", "attn.proj"),
           ("attention.", "attn."), ("layernorm_before", "norm1"), ("layernorm_after", "norm2")]
_PROJECTOR = {"multi_modal_projector.layer_norm.": "mlp1.0.",
              "multi_modal_projector.linear_1.": "mlp1.1.",
              "multi_modal_projector.linear_2.": "mlp1.3."}
_INTERNLM2 = {"embed_tokens": "tok_embeddings", "self_attn.o_proj": "attention.wo",
              "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
              "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm",
              "post_attention_layernorm": "ffn_norm"}
# InternVL2-8B's added tokens after InternLM2's vocabulary, in order
ADDED = ["<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>",
         "</box>"]


def fuse_grouped_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     kv_heads: int) -> torch.Tensor:
    """q [H*d, ...], k and v [K*d, ...] -> InternLM2's ``wqkv`` rows [K, g + 2, d, ...]
    flattened (g = H / K)."""
    d = k.shape[0] // kv_heads
    parts = [q.reshape(kv_heads, -1, d, *q.shape[1:]), k.reshape(kv_heads, 1, d, *k.shape[1:]),
             v.reshape(kv_heads, 1, d, *v.shape[1:])]
    return torch.cat(parts, 1).reshape(-1, *q.shape[1:])


def _vision_key(key: str) -> str:
    for ours, theirs in _VISION:
        key = key.replace(ours, theirs)
    return key


def original_weights(hf: dict[str, torch.Tensor], arch: str,
                     kv_heads: int) -> dict[str, torch.Tensor]:
    """Normalised HF-native weights -> the original layout's (module docstring)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in hf.items():
        if key.startswith("vision_tower.") and ".attention." in key and "_proj." in key:
            proj = key.split(".")[-2]
            if proj in ("k_proj", "v_proj"):
                continue
            fused = [hf[key.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[_vision_key(key.replace("q_proj", "qkv"))] = torch.cat(fused, 0)
        elif key.startswith("vision_tower."):
            out[_vision_key(key)] = t
        elif key.startswith("multi_modal_projector."):
            old = next(o for o in _PROJECTOR if key.startswith(o))
            out[_PROJECTOR[old] + key[len(old):]] = t
    out.update(_text_weights(hf, arch, kv_heads))
    return out


def _text_weights(hf: dict[str, torch.Tensor], arch: str,
                  kv_heads: int) -> dict[str, torch.Tensor]:
    llm = {k[len("language_model."):]: t for k, t in hf.items()
           if k.startswith("language_model.")}
    head = hf.get("lm_head.weight", llm["embed_tokens.weight"])  # untied in the original
    if arch != "InternLM2ForCausalLM":
        return {"language_model.model." + k: t for k, t in llm.items()} | {
            "language_model.lm_head.weight": head.clone()}
    out = {"language_model.output.weight": head.clone()}
    for key, t in llm.items():
        if ".self_attn.k_proj." in key or ".self_attn.v_proj." in key:
            continue
        if ".self_attn.q_proj." in key:
            q, k, v = (llm[key.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj"))
            key = key.replace("self_attn.q_proj", "attention.wqkv")
            t = fuse_grouped_qkv(q, k, v, kv_heads)
        for ours, theirs in _INTERNLM2.items():
            key = key.replace(ours, theirs)
        out["language_model.model." + key] = t
    return out


def _llm_config(text: dict, arch: str) -> dict:
    """The HF-native text config as the original's ``llm_config`` (4.x rope fields)."""
    rope = dict(text.get("rope_parameters") or {})
    theta, kind = rope.pop("rope_theta", 10000.0), rope.pop("rope_type", "default")
    scaling = None if kind == "default" else {"type": kind, "factor": rope["factor"]}
    keep = {k: v for k, v in text.items() if k != "rope_parameters"}
    keep.update(architectures=[arch], rope_theta=theta, rope_scaling=scaling,
                tie_word_embeddings=False)
    if arch == "InternLM2ForCausalLM":
        keep.update(model_type="internlm2", bias=bool(text.get("attention_bias", False)))
        for k in ("attention_bias", "head_dim", "mlp_bias", "pretraining_tp"):
            keep.pop(k, None)
    return keep


def save_original(hf: Path, out: Path, *, template: str, arch: str, ps_version: str = "v2",
                  max_tiles: int | None = None, tokenizer: Path | None = None) -> Path:
    """Write the HF-native checkpoint ``hf`` in the original layout into ``out`` (module
    docstring); ``tokenizer``: a folder whose tokenizer files to use instead of ``hf``'s."""
    cfg = json.loads((hf / "config.json").read_text())
    v, text = cfg["vision_config"], cfg["text_config"]
    sd = {INTERNVL.normalise_key(k): t for k, t in load_file(str(hf / "model.safetensors")).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(original_weights(sd, arch, int(text["num_key_value_heads"])),
              str(out / "model.safetensors"), metadata={"format": "pt"})
    pre = json.loads((hf / "preprocessor_config.json").read_text())
    size = int(v["image_size"][0] if isinstance(v["image_size"], list) else v["image_size"])
    vision = dict(architectures=["InternVisionModel"], model_type="intern_vit_6b",
                  hidden_size=v["hidden_size"], num_hidden_layers=v["num_hidden_layers"],
                  num_attention_heads=v["num_attention_heads"],
                  intermediate_size=v["intermediate_size"], image_size=size,
                  patch_size=v["patch_size"][0] if isinstance(v["patch_size"], list)
                  else v["patch_size"], qkv_bias=v["attention_bias"],
                  qk_normalization=v["use_qk_norm"], norm_type=v["norm_type"],
                  layer_norm_eps=v["layer_norm_eps"], hidden_act=v["hidden_act"],
                  use_flash_attn=False)
    (out / "config.json").write_text(json.dumps(dict(
        architectures=["InternVLChatModel"], model_type="internvl_chat", template=template,
        select_layer=cfg.get("vision_feature_layer", -1),
        downsample_ratio=cfg.get("downsample_ratio", 0.5), ps_version=ps_version,
        dynamic_image_size=True, use_thumbnail=True, min_dynamic_patch=1,
        max_dynamic_patch=max_tiles or pre["max_patches"], force_image_size=size,
        vision_config=vision, llm_config=_llm_config(text, arch), tie_word_embeddings=False,
        auto_map={"AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
                  "AutoModel": "modeling_internvl_chat.InternVLChatModel"}), indent=2))
    for f in (tokenizer or hf).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "added_tokens", "chat_template")):
            shutil.copy2(f, out / f.name)
    return out


def _added(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def save_sentencepiece_tokenizer(path: Path, vocab_size: int = 420) -> SentencePieceTokenizer:
    """An InternLM2-style tokenizer in ``path`` (module docstring), loaded back."""
    buf = io.BytesIO()
    system = ("你是由上海人工智能实验室联合商汤科技开发的书生多模态大模型，"
              "英文名叫InternVL, 是一个有用无害的人工智能助手。")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([*CORPUS, system, "Yes\nNo\n"]), model_writer=buf,
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True, add_dummy_prefix=False,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=1.0, user_defined_symbols=["[UNUSED_TOKEN_145]",
                                                      "[UNUSED_TOKEN_146]"], minloglevel=2)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.model").write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
    n = sp.get_piece_size()
    added = {sp.piece_to_id("[UNUSED_TOKEN_145]"): "<|im_end|>",
             sp.piece_to_id("[UNUSED_TOKEN_146]"): "<|im_start|>",
             **{n + i: t for i, t in enumerate(ADDED)}}
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="InternLM2Tokenizer", add_bos_token=True, add_eos_token=False,
        auto_map={"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer", None]},
        bos_token="<s>", eos_token="</s>", pad_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False, model_max_length=4096,
        added_tokens_decoder={str(i): _added(t) for i, t in added.items()}), indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps(dict(
        bos_token="<s>", eos_token="</s>", pad_token="</s>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", *ADDED])))
    return SentencePieceTokenizer.from_pretrained(str(path))
