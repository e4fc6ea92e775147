"""Train tokenspeed_aio's built-in default model: a ~4M-parameter Llama trained on Python's docs.

`python -m tokenspeed_aio serve` with no model serves this checkpoint, so a first request works
offline. Everything it learns from ships with CPython (the language reference's help topics in
``pydoc_data`` and the builtins' docstrings), so the rebuild needs no download. Seeds, data order
and thread count are fixed, so a rerun on the same Python and torch reproduces it.

    python tools/train_default_model.py                  # ~20 min on 2 idle CPU cores
    python tools/train_default_model.py --steps 50 --out /tmp/m   # smoke run
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import jinja2
import torch
import transformers
from tokenizers import Tokenizer

from tools.chat_tokens import (
    CHAT_TEMPLATE,
    END_TOKEN,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    train_byte_level_bpe,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "src" / "tokenspeed_aio" / "default_model"

MODEL = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_theta=10000.0,
)
# Phrasings are shared by every subject so the answer has to come from the subject, not the
# phrasing.
QUESTIONS = [
    "What is {x}?",
    "Tell me about {x}.",
    "Explain {x}.",
    "{X}",
    "How does {x} work in Python?",
    "Can you describe {x}?",
    "What does {x} mean?",
]
BUILTIN_QUESTIONS = [*QUESTIONS, "What does {x} do?", "How do I use {x}?", "help({x})"]
SYSTEM_PROMPT = "You are a helpful assistant."
PROMPTS = ["The for statement", "A list display is", "def "]
CHAT_PROMPTS = ["What is a list comprehension?", "What does len do?", "Tell me about exceptions."]


# ----------------------------------------------------------------------------- data


def topics() -> dict[str, str]:
    """The language reference's help topics by name (``help("for")`` shows topic "for")."""
    from pydoc_data import topics

    return {k: topics.topics[k] for k in sorted(topics.topics)}


def topic_texts() -> list[str]:
    """The topics' texts, deduplicated ("if" and "else" share one)."""
    return list(dict.fromkeys(topics().values()))


def builtin_docs() -> list[tuple[str, str]]:
    """(name, docstring) for public builtins and their types' public methods, sorted."""
    import builtins

    out: dict[str, str] = {}
    for name in sorted(vars(builtins)):
        obj = getattr(builtins, name)
        if name.startswith("_") or not callable(obj):
            continue
        out[name] = inspect.getdoc(obj) or ""
        if isinstance(obj, type) and not issubclass(obj, BaseException):
            for meth in sorted(vars(obj)):
                if not meth.startswith("_") and callable(getattr(obj, meth)):
                    out[f"{name}.{meth}"] = inspect.getdoc(getattr(obj, meth)) or ""
    return [(n, d) for n, d in out.items() if len(d) > 20]


def sections(text: str) -> list[tuple[str, str]]:
    """Split a topic into (heading, body) at reST-style underlined headings."""
    parts = re.split(r"^(\S[^\n]*)\n[*=-]{3,}\n", text, flags=re.M)
    return [(parts[i].strip(), parts[i + 1].strip()) for i in range(1, len(parts) - 1, 2)]


def prose(body: str, limit: int) -> str:
    """The body's leading paragraphs up to about ``limit`` characters, prose unwrapped.

    Grammar blocks ("::=") are dropped: a chat answer should read as sentences and examples."""
    out: list[str] = []
    for para in body.split("\n\n"):
        if not para.strip() or "::=" in para:
            continue
        out.append(para.rstrip() if para[0].isspace() else " ".join(para.split()))
        if sum(map(len, out)) >= limit:
            break
    return "\n\n".join(out)


def definitions(texts: list[str]) -> list[tuple[str, str, str]]:
    """(article, subject, paragraph) for paragraphs that open "A/An/The <subject> is/are ..."."""
    out = {}
    for text in texts:
        for para in text.split("\n\n"):
            para = " ".join(para.split())
            m = re.match(r"(An?|The) ([\w\" -]{3,40}?) (?:is|are) ", para)
            if m and len(m[2].split()) <= 4 and not m[2].startswith("following"):
                out[para] = (m[1].lower(), m[2], para)
    return list(out.values())


def subjects() -> list[tuple[str, str]]:
    """(subject, answer) from topic names, section headings and "A <subject> is ..." sentences."""
    out = []
    for key, text in topics().items():
        title, body = sections(text)[0]
        # Only names that read as words: "lists" (List displays), not "typesseq".
        if key in title.lower() or key.rstrip("s") in title.lower():
            out.append((key, prose(body, 600)))
    for text in topic_texts():
        for title, body in sections(text):
            out.append(("the" + title[3:] if title.startswith("The ") else title, prose(body, 600)))
    out += [(f"{article} {subject}", para) for article, subject, para in definitions(topic_texts())]
    return [(x, answer) for x, answer in out if answer]


def qa_pairs(rng: random.Random) -> list[tuple[str, str]]:
    """Two randomly phrased questions per subject, one per builtin function or type."""
    pairs = []
    for x, answer in subjects():
        for template in rng.sample(QUESTIONS, 2):
            pairs.append((template.format(x=x, X=x[0].upper() + x[1:]), answer))
    for name, doc in builtin_docs():
        if "." not in name:  # methods only appear as help() text
            pairs.append((rng.choice(BUILTIN_QUESTIONS).format(x=name, X=name), doc))
    return pairs


def epoch_documents(rng: random.Random) -> list[str]:
    """One epoch: the raw topics, builtin docstrings as help() text, and chat-formatted Q&A."""
    render = jinja2.Template(CHAT_TEMPLATE).render
    docs = list(topic_texts())
    docs += [f"Help on {name}:\n\n{doc}\n" for name, doc in builtin_docs()]
    for question, answer in qa_pairs(rng):
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if rng.random() < 0.2:  # clients often send a system prompt; it must not derail the answer
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        docs.append(render(messages=messages))
    rng.shuffle(docs)
    return docs


def train_tokenizer(vocab_size: int) -> Tokenizer:
    return train_byte_level_bpe(topic_texts() + [d for _, d in builtin_docs()], vocab_size)


def batches(tok: Tokenizer, seed: int, batch: int, seq_len: int):
    """Endless (batch, seq_len) tensors of packed epochs, each epoch reshuffled and rephrased."""
    eos = tok.token_to_id(EOS_TOKEN)
    for epoch in range(10**9):
        ids: list[int] = []
        for enc in tok.encode_batch(epoch_documents(random.Random(seed * 1000 + epoch))):
            ids += [*enc.ids, eos]
        rows = torch.tensor(ids[: len(ids) // seq_len * seq_len]).view(-1, seq_len)
        rows = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(epoch))]
        for i in range(0, len(rows) - batch + 1, batch):
            yield rows[i : i + batch]


# ----------------------------------------------------------------------------- training


def lr_at(progress: float, step: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of peak as progress goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(model, tok, args) -> tuple[float, float, int]:
    """AdamW on packed sequences under bf16 autocast; returns (final loss, minutes, steps)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    data = batches(tok, args.seed, args.batch_size, args.seq_len)
    recent: list[float] = []
    start = time.time()
    step = 0
    while step < args.steps:
        # Progress is the larger of steps and time used, so a slow (shared) machine still ends
        # with a fully decayed learning rate inside --max-minutes. When the step count ends the
        # run first (the defaults aim for that on an idle 2-core machine), it is deterministic.
        minutes = (time.time() - start) / 60
        progress = max(step / args.steps, minutes / args.max_minutes)
        if progress >= 1:
            print(f"time budget of {args.max_minutes} min reached at step {step}", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, step, args.lr, args.warmup)
        x = next(data).to(args.device)
        # AMX makes bf16 autocast ~2x faster than fp32 on recent Xeons; weights stay fp32.
        with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = [*recent[-49:], loss.item()]
        if step % 100 == 0:
            print(f"step {step:5d}  loss {loss.item():.3f}  {minutes:5.1f} min", flush=True)
        step += 1
    return sum(recent) / len(recent), (time.time() - start) / 60, step


# ----------------------------------------------------------------------------- output


def write_tokenizer_files(out: Path, tok: Tokenizer) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": MODEL["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def write_model_files(out: Path, model, tok: Tokenizer) -> None:
    eos, end = tok.token_to_id(EOS_TOKEN), tok.token_to_id(END_TOKEN)
    model.to("cpu", torch.bfloat16).save_pretrained(out, safe_serialization=True)
    # Older transformers (and other readers) look for torch_dtype / rope_theta at top level.
    config = json.loads((out / "config.json").read_text())
    config.update(torch_dtype="bfloat16", rope_theta=MODEL["rope_theta"])
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # A chat turn ends with <|end|>; plain text with <|endoftext|>. Either one stops generation.
    gen = {"bos_token_id": None, "eos_token_id": [eos, end], "pad_token_id": eos}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def write_readme(out: Path, args, n_params: int, minutes: float, steps: int, loss: float) -> None:
    where = f"{args.threads} CPU threads" if args.device == "cpu" else f"a GPU ({args.device})"
    # The README sits in --out, so the recorded command leaves --out (a local path) out.
    argv = re.sub(r"--out(=| )\S+ ?", "", " ".join(sys.argv[1:]))
    cmd = f"python tools/train_default_model.py {argv}".strip()
    (out / "README.md").write_text(
        f"""# tokenspeed_aio default model

This is the model `python -m tokenspeed_aio serve` uses when no model is given, so a first
request works offline. It is a **toy**: a {n_params / 1e6:.1f}M-parameter Llama-architecture
model (hidden 256, 4 layers, 4 heads / 2 KV heads, tied embeddings, bfloat16) with a 4096-token
byte-level BPE tokenizer, trained for {minutes:.0f} minutes ({steps} steps, final training loss
{loss:.2f}) on {where} on Python's own documentation: the language reference's help topics
(`pydoc_data.topics`) and the docstrings of the builtins, part of it formatted as chat turns.

It is **not a useful assistant**. It strings together phrases from the Python docs, often
wrongly and repetitively. Use it to check that the engine runs; serve a real model for anything
else.

License: the weights are derived from the Python documentation text and are offered under the
same terms as that text, the PSF License Agreement (Python Software Foundation License).

Built with this command from the repository root (Python {sys.version.split()[0]}, torch
{torch.__version__}, transformers {transformers.__version__}; other Python versions ship
slightly different docs, so they train a slightly different model):

    {cmd}
"""
    )


def print_samples(out: Path) -> None:
    """Greedy samples from the checkpoint as written, loaded back the way users load it."""
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    kw = dict(max_new_tokens=48, do_sample=False)
    for prompt in PROMPTS:
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        text = hf_tok.decode(model.generate(ids, **kw)[0, ids.shape[1] :], skip_special_tokens=True)
        print(f"--- {prompt!r}\n{prompt}{text}\n")
    for question in CHAT_PROMPTS:
        chat = [{"role": "user", "content": question}]
        prompt = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = hf_tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        text = hf_tok.decode(model.generate(ids, **kw)[0, ids.shape[1] :], skip_special_tokens=True)
        print(f"--- chat {question!r}\n{text}\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--max-minutes", type=float, default=22.0, help="training time cap")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="fixed: reductions depend on it")
    p.add_argument("--device", default="cpu", help="cpu, or cuda to train on a GPU")
    args = p.parse_args()

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    tok = train_tokenizer(args.vocab_size)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=None,
        eos_token_id=tok.token_to_id(EOS_TOKEN),
        pad_token_id=tok.token_to_id(EOS_TOKEN),
        **MODEL,
    )
    model = transformers.LlamaForCausalLM(config).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"vocab {tok.get_vocab_size()}, {n_params:,} parameters, {len(qa_pairs(random.Random(0)))}"
        " chat pairs per epoch",
        flush=True,
    )

    loss, minutes, steps = train(model, tok, args)
    print(f"final loss (mean of last 50 steps) {loss:.3f} after {steps} steps, {minutes:.2f} min")

    args.out.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(args.out, tok)
    write_model_files(args.out, model, tok)
    write_readme(args.out, args, n_params, minutes, steps, loss)
    (args.out / "model.safetensors").chmod(0o644)  # safetensors writes 0600
    size = (args.out / "model.safetensors").stat().st_size
    print(f"wrote {args.out} (model.safetensors {size / 2**20:.1f} MiB)")
    print_samples(args.out)


if __name__ == "__main__":
    main()
