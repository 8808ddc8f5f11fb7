"""English-like text for the serving workloads, generated from a fixed vocabulary.

Real tokenizers behave differently on random token ids than on prose (merges,
spaces, punctuation), so prompts are sentences built from templates and word
lists written for this file. A `random.Random` drives every choice, so the
same seed gives the same text on every machine and Python version.
"""

from __future__ import annotations

import random

# Roughly 1.2 tokens per word on GPT-2-style BPE vocabularies (SmolLM2, Llama 3)
# for this vocabulary, punctuation included; used to aim at a token count.
TOKENS_PER_WORD = 1.2

_NOUNS = (
    "river harbour lantern market engine letter garden bridge window journey orchard "
    "signal village merchant ferry mill tower valley meadow library clock workshop "
    "farmer captain teacher baker sailor weaver miller painter doctor traveller "
    "road forest castle island station kitchen courtyard chapel vineyard quarry "
    "storm season harvest festival council ledger cargo compass map lamp candle "
    "canal dock warehouse granary bell fountain square gate wall school"
).split()
_ADJECTIVES = (
    "old quiet narrow busy distant bright grey northern ancient wooden broken "
    "careful patient crowded empty golden heavy hidden early late small famous "
    "steady cold warm gentle strange simple"
).split()
_VERBS = (
    "crossed repaired visited watched followed carried opened painted described "
    "measured guarded rebuilt remembered counted mapped sold bought found lost "
    "cleaned lit closed named praised"
).split()
_PLACES = (
    "by the river|near the harbour|beyond the hills|under the old bridge|"
    "at the edge of the market|behind the mill|along the canal|inside the tower|"
    "across the valley|at the end of the road"
).split("|")
_TIMES = (
    "In the spring|Every morning|Before the storm|After the harvest|Late one evening|"
    "During the long winter|On the first day of the festival|Years ago|At dawn|"
    "When the bells rang"
).split("|")
_QUESTION_OPENERS = (
    "Can you explain|Why do you think|How would you describe|What happened when|"
    "Could you tell me more about how|What is the best way to understand why|"
    "In a few words, summarise how|Which detail shows how"
).split("|")


def _noun_phrase(rng: random.Random) -> str:
    return f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"


def sentence(rng: random.Random) -> str:
    """One declarative sentence, e.g. 'Before the storm the old ferry crossed the mill.'"""
    shape = rng.randrange(4)
    subject, obj = _noun_phrase(rng), _noun_phrase(rng)
    verb, place = rng.choice(_VERBS), rng.choice(_PLACES)
    if shape == 0:
        text = f"{rng.choice(_TIMES)} {subject} {verb} {obj} {place}."
    elif shape == 1:
        text = f"{subject} {verb} {obj}, and {_noun_phrase(rng)} {rng.choice(_VERBS)} it {place}."
    elif shape == 2:
        text = f"{subject} {place} was {rng.choice(_VERBS)} by {obj}."
    else:
        text = f"Nobody {place} {verb} {obj} as carefully as {subject}."
    return text[0].upper() + text[1:]


def paragraph(rng: random.Random, approx_tokens: int) -> str:
    """Sentences until about `approx_tokens` tokens (at least one sentence)."""
    target_words = max(1, round(approx_tokens / TOKENS_PER_WORD))
    words: list[str] = []
    while len(words) < target_words:
        words += sentence(rng).split()
    return " ".join(words)


def text(rng: random.Random, approx_tokens: int, paragraph_tokens: int = 120) -> str:
    """Paragraphs separated by blank lines, about `approx_tokens` tokens in all."""
    parts: list[str] = []
    left = approx_tokens
    while left > 0:
        n = min(paragraph_tokens, left)
        parts.append(paragraph(rng, n))
        left -= n
    return "\n\n".join(parts)


def question(rng: random.Random, approx_tokens: int) -> str:
    """A question about the story, padded with context sentences to about `approx_tokens`."""
    ask = f"{rng.choice(_QUESTION_OPENERS)} {_noun_phrase(rng)} {rng.choice(_VERBS)} "
    ask += f"{_noun_phrase(rng)} {rng.choice(_PLACES)}?"
    asked = len(ask.split()) * TOKENS_PER_WORD
    if approx_tokens - asked < 8:
        return ask
    return paragraph(rng, round(approx_tokens - asked)) + " " + ask
