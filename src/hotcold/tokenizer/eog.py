"""End-of-generation tokens, as llama.cpp derives them (src/llama-vocab.cpp, `special_eog_ids`).

Chat models end a turn with a token that is often not the file's EOS (Llama 3 `<|eot_id|>`, Qwen `<|im_end|>`,
Gemma `<end_of_turn>`, Phi-3 `<|end|>`). llama.cpp stops on every token of a set it builds from:
- the FIM pad, repo and file-separator tokens (`tokenizer.ggml.fim_{pad,rep,sep}_token_id`, else the first
  token whose text is one of `FIM_PAD_TEXTS`, `FIM_REP_TEXTS`, `FIM_SEP_TEXTS`);
- every token whose text is one of `EOG_TEXTS`, whatever its type (Qwen2's normal token "</s>" too);
- the file's `eos_token_id`, `eot_token_id` and `eom_token_id` (its text rules for EOT and EOM pick texts
  that `EOG_TEXTS` already holds, so they add nothing here);
then drops `<|end|>` where `<|return|>` / `<|call|>` or `<|calls|>` / `<|flush|>` end turns instead (gpt-oss,
Solar Open), and "</s>" where `<|tool_response>` or `<|plamo:eos|>` is in the set (Gemma 4, PLaMo: there
"</s>" is ordinary text).

Where a file names no EOS, llama.cpp assumes id 2 (SentencePiece) or 11 (byte-level BPE); hotcold does not
(in a byte-level vocabulary 11 is an ordinary token such as ","), so such a file stops on its texts alone.
Where several texts of one FIM list are in a vocabulary, llama.cpp takes whichever its hash map gives first;
hotcold takes them in the list's order."""

from __future__ import annotations

from collections.abc import Sequence

EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",  # o200k_harmony
    "<|call|>",  # o200k_harmony
    "<|flush|>",  # solar-open
    "<|calls|>",  # solar-open
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",  # paddleocr
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",  # Kimi-K2
    "[EOS]",  # Kimi-K2
    "<|end_of_text|>",
    "<end_of_utterance>",  # smoldocling
    "<eos>",  # gemma4
    "<turn|>",  # gemma4
    "<|tool_response>",  # gemma4
    "<｜end▁of▁sentence｜>",  # deepseek-ocr
    "[e~[",  # minimax-m2/m3
)
FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FIM_SEP_TEXTS = ("<|file_sep|>",)


def derive_eog_ids(
    tokens: Sequence[str],
    *,
    eos_id: int | None = None,
    eot_id: int | None = None,
    eom_id: int | None = None,
    fim_pad_id: int | None = None,
    fim_rep_id: int | None = None,
    fim_sep_id: int | None = None,
) -> frozenset[int]:
    """The ids that end generation in a vocabulary of `tokens`, given the special ids the file names."""
    index = {
        text: i for i, text in enumerate(tokens)
    }  # a text twice: the last id, as llama.cpp's token_to_id
    ids = set()
    for named, texts in (
        (fim_pad_id, FIM_PAD_TEXTS),
        (fim_rep_id, FIM_REP_TEXTS),
        (fim_sep_id, FIM_SEP_TEXTS),
    ):
        found = named if named is not None else next((index[t] for t in texts if t in index), None)
        if found is not None:
            ids.add(found)
    ids.update(index[t] for t in EOG_TEXTS if t in index)
    ids.update(i for i in (eos_id, eot_id, eom_id) if i is not None)
    texts = {tokens[i] for i in ids}
    calls = "<|call|>" in texts or "<|calls|>" in texts
    if calls and ("<|return|>" in texts or "<|flush|>" in texts):
        ids = {i for i in ids if tokens[i] != "<|end|>"}
    if "<|tool_response>" in texts or "<|plamo:eos|>" in texts:
        ids = {i for i in ids if tokens[i] != "</s>"}
    return frozenset(ids)
