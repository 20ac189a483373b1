"""Text for CLIP (its room for captions; ``minivit.captions`` is its old name): a word-level tokenizer, OpenAI's
byte-level BPE, and data sets of (image, caption) pairs that work offline.

    tok = Tokenizer.from_captions(data.text_train, context_length=16)
    tokens = tok(["a small red circle", "a blue ring on the left"])   # int64 (2, 16)

Token ids, as CLIP lays them out: 0 is <pad>, 1 <unk>, 2 <start>, then the words in sorted order, and
<end> the HIGHEST id. A caption becomes [<start>, w1, ..., wn, <end>, <pad>, ...] of length L (the
context length); the text tower reads the features at the <end> token, found as the argmax of the ids.

Data sets (``load_captioned(name)``):
- "shapes": minivit's procedural shapes (minivit.data.synthetic) drawn in one of six named colours, small or large, on
  the left or the right, each image with one caption made from those attributes in one of several
  phrasings ("a small red triangle on the left", "the ring is blue", ...). Some colour-shape
  combinations (HELD_OUT) never occur in training: zero-shot on them asks whether the model composes
  "red" and "circle" without ever having seen a red circle.
- "fashion-mnist": Fashion-MNIST (Debian's copy) with captions from its class names and each image's
  shade ("a photo of a dark coat").
A batch must not hold two identical captions: the contrastive loss would call the second pair a
negative although it matches as well as the first (a false negative). ``batch_indices`` sees to it.

Glossary: N images, H, W, C image sizes, L context length, V vocabulary size, K zero-shot classes.
"""

import re
import warnings
from dataclasses import dataclass

import numpy

from .. import data as D
from ..backend import host_rng
from ..data.synthetic import _draw_shape_images

PAD, UNK, START, END = "<pad>", "<unk>", "<start>", "<end>"
_WORD = re.compile(r"[a-z0-9]+(?:[-'][a-z0-9]+)*|[^\sa-z0-9]")   # words (with inner - or '), or one sign


def split_words(text):
    """The words of a caption: lower-cased, "L-shape" kept whole, punctuation a word of its own."""
    if not isinstance(text, str):
        raise TypeError(f"a caption must be a str, got {type(text).__name__}: {text!r}")
    return _WORD.findall(text.lower())


class Tokenizer:
    """Word-level: ids 0 <pad>, 1 <unk>, 2 <start>, 3 ... the words (sorted), V - 1 <end> (the highest)."""

    def __init__(self, words, context_length=16):
        if isinstance(words, str):
            raise TypeError(f"words must be a collection of words, got the string {words!r}")
        words = sorted(set(words))
        bad = [w for w in words if not isinstance(w, str) or split_words(w) != [w]]
        if bad:
            raise ValueError(f"vocabulary entries must be single lower-case words, got {bad[:5]}")
        if not isinstance(context_length, int) or isinstance(context_length, bool) or context_length < 3:
            raise ValueError(f"context_length must be an int >= 3 (<start>, a word, <end>), got {context_length!r}")
        self.words, self.context_length = words, context_length
        self.itos = [PAD, UNK, START] + words + [END]           # id -> token
        self.stoi = {s: i for i, s in enumerate(self.itos)}     # token -> id
        self.pad_id, self.unk_id, self.start_id, self.end_id = 0, 1, 2, len(self.itos) - 1

    @classmethod
    def from_captions(cls, captions, context_length=16):
        """The vocabulary of every word in captions (a list of str)."""
        return cls({w for c in captions for w in split_words(c)}, context_length)

    @property
    def vocab_size(self):
        """V: the words plus <pad>, <unk>, <start> and <end>."""
        return len(self.itos)

    def encode(self, texts):
        """texts: a str or a list of B str. Returns int64 tokens (B, L): [<start>, words, <end>, <pad>...].
        Unknown words become <unk>, with one warning naming them; a caption longer than L - 2 words is
        refused (a ValueError naming it) rather than cut, which would silently change its meaning."""
        if isinstance(texts, str):
            texts = [texts]
        L = self.context_length
        tokens = numpy.full((len(texts), L), self.pad_id, dtype=numpy.int64)   # (B, L)
        unknown = set()
        for b, text in enumerate(texts):
            words = split_words(text)
            if len(words) + 2 > L:
                raise ValueError(f"caption {text!r} has {len(words)} words, more than context_length - 2 = "
                                 f"{L - 2} (with <start> and <end>); use a larger context_length")
            ids = [self.stoi.get(w, self.unk_id) for w in words]
            unknown.update(w for w in words if w not in self.stoi)
            tokens[b, :len(ids) + 2] = [self.start_id] + ids + [self.end_id]
        if unknown:
            warnings.warn(f"words not in the vocabulary, encoded as {UNK}: {sorted(unknown)}", stacklevel=2)
        return tokens

    __call__ = encode

    def decode(self, tokens):
        """int tokens (B, L) -> B str: the words between <start> and <end>."""
        out = []
        for row in numpy.asarray(tokens):
            words = [self.itos[i] for i in row if i not in (self.pad_id, self.start_id, self.end_id)]
            out.append(" ".join(words))
        return out

    def to_dict(self):
        return {"words": list(self.words), "context_length": self.context_length}

    @classmethod
    def from_dict(cls, d):
        return cls(d["words"], d["context_length"])

    def __repr__(self):
        return f"Tokenizer(vocab_size={self.vocab_size}, context_length={self.context_length})"


def _bytes_to_unicode():
    """OpenAI's table: each of the 256 bytes -> a printable character (printable bytes map to themselves),
    so that a BPE vocabulary of strings covers every byte sequence."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# OpenAI's pattern with \p{L} (letters) and \p{N} (numbers) in Python's re: [^\W\d_] and \d. They differ only for
# rare numerals (a "½" is \p{N} but not \d), which this splits as a sign instead of a number.
_BPE_SPLIT = re.compile(r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[^\W\d_]+|\d|(?:_|[^\s\w])+",
                        re.IGNORECASE)


class BPETokenizer:
    """CLIP's byte-pair tokenizer (OpenAI's simple_tokenizer), read from a Hugging Face CLIP folder's
    vocab.json and merges.txt, so a transformers CLIPModel can be used for zero-shot with its own ids:

        tok = BPETokenizer.from_pretrained("clip-vit-base-patch32", context_length=model.config.context_length)
        tokens = tok(["a photo of a cat"])              # int64 (1, L): [<|startoftext|>, ..., <|endoftext|>, 0...]

    A word is lower-cased, its UTF-8 bytes written as characters, and then the adjacent pair with the lowest
    merge rank is joined, again and again, until no pair is in merges.txt; the last piece carries "</w>".
    Padding is 0, as open_clip's; the text tower reads <|endoftext|> either as the highest id or as the
    first eos (both are the same position here). ftfy's mojibake repair is not done."""

    def __init__(self, encoder, merges, context_length=77):
        if not isinstance(context_length, int) or isinstance(context_length, bool) or context_length < 3:
            raise ValueError(f"context_length must be an int >= 3, got {context_length!r}")
        self.encoder, self.context_length = encoder, context_length
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.byte_encoder = _bytes_to_unicode()
        for special in ("<|startoftext|>", "<|endoftext|>"):
            if special not in encoder:
                raise ValueError(f"the vocabulary has no {special} token: not CLIP's")
        self.start_id, self.end_id = encoder["<|startoftext|>"], encoder["<|endoftext|>"]
        self.cache = {}

    @classmethod
    def from_pretrained(cls, folder, context_length=77):
        """vocab.json ({token: id}) and merges.txt (a "#version" line, then one "a b" pair per line)."""
        import json
        import os

        paths = [os.path.join(os.fspath(folder), n) for n in ("vocab.json", "merges.txt")]
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise ValueError(f"{os.fspath(folder)!r} has no {', '.join(os.path.basename(p) for p in missing)}: "
                             f"CLIP's BPE tokenizer needs both (a Hugging Face CLIP folder has them)")
        with open(paths[0], encoding="utf-8") as f:
            encoder = json.load(f)
        with open(paths[1], encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#version")]
        merges = [tuple(line.split(" ")) for line in lines]
        bad = [line for line in lines if len(line.split(" ")) != 2][:3]
        if bad:
            raise ValueError(f"{paths[1]!r}: each line must be a pair 'a b', got {bad}")
        return cls(encoder, merges, context_length)

    def bpe(self, word):
        """One word (already in byte characters) -> its pieces, merged by rank."""
        if word in self.cache:
            return self.cache[word]
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        while len(parts) > 1:
            pairs = [(self.ranks.get(pair, len(self.ranks)), i) for i, pair in enumerate(zip(parts, parts[1:]))]
            rank, _ = min(pairs)
            if rank == len(self.ranks):
                break                                         # no pair left to merge
            first, second = None, None
            for r, i in pairs:
                if r == rank:
                    first, second = parts[i], parts[i + 1]
                    break
            merged, i = [], 0                                 # join every occurrence of the pair, left to right
            while i < len(parts):
                if i < len(parts) - 1 and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        self.cache[word] = parts
        return parts

    def ids(self, text):
        """One str -> its ids, without <|startoftext|> and <|endoftext|>."""
        if not isinstance(text, str):
            raise TypeError(f"a caption must be a str, got {type(text).__name__}: {text!r}")
        text = " ".join(text.split()).lower()                 # whitespace_clean, then lower-case
        out = []
        for word in _BPE_SPLIT.findall(text):
            if word in ("<|startoftext|>", "<|endoftext|>"):
                out.append(self.encoder[word])
                continue
            chars = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            out.extend(self.encoder[piece] for piece in self.bpe(chars))
        return out

    def encode(self, texts):
        """texts: a str or a list of B str -> int64 (B, L): [<|startoftext|>, ids, <|endoftext|>, 0, ...]; a
        caption longer than L - 2 tokens is cut to fit, <|endoftext|> kept last (as open_clip and OpenAI do)."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        L = self.context_length
        out = numpy.zeros((len(texts), L), dtype=numpy.int64)
        for b, text in enumerate(texts):
            row = [self.start_id] + self.ids(text)[:L - 2] + [self.end_id]
            out[b, :len(row)] = row
        return out

    __call__ = encode


# ---------------------------------------------------------------------------------------------------
# Captioned data sets
# ---------------------------------------------------------------------------------------------------


@dataclass
class CaptionedDataset:
    """(image, caption) pairs, plus what zero-shot classification of the test images needs."""

    name: str                 # "shapes" | "fashion-mnist"
    x_train: numpy.ndarray    # uint8 (N, H, W, C)
    text_train: list          # N captions
    y_train: numpy.ndarray    # int64 (N,): each image's zero-shot class, an index into classnames
    x_test: numpy.ndarray     # uint8 (N_test, H, W, C)
    text_test: list           # N_test captions
    y_test: numpy.ndarray     # int64 (N_test,)
    classnames: list          # K zero-shot classes, e.g. "red circle"; prompts are templates filled with them
    templates: list           # e.g. ["a {}", "a photo of a {}"]
    held_out: list            # class indices that never occur in training (the compositional test)
    mean: tuple               # per channel, in [0, 1] units: normalise as (x / 255 - mean) / std
    std: tuple

    @property
    def image_shape(self):
        return tuple(self.x_train.shape[1:])

    @property
    def num_classes(self):
        return len(self.classnames)

    @property
    def classes(self):        # the trainer's name for them
        return self.classnames


# ---- shapes, with named colours, sizes and sides ---------------------------------------------------

SHAPE_NOUNS = ["circle", "square", "triangle", "ring", "cross", "horizontal bar", "vertical bar", "diamond",
               "pair of dots", "L-shape"]                # data.SHAPES_CLASSES as a caption says them
COLOURS = {"red": (225, 45, 45), "green": (45, 200, 70), "blue": (60, 100, 245), "yellow": (235, 215, 40),
           "magenta": (220, 60, 210), "white": (235, 235, 235)}   # RGB; each image jitters them by +-20
COLOUR_NAMES = list(COLOURS)
SIZES = {"small": (0.20, 0.27), "large": (0.32, 0.40)}   # the shape's radius, a fraction of the image side
SIDES = ("left", "right")                                # the centre at least 1.5 px left or right of the middle
# shape k in colour k mod 6, never in training: each shape and each colour is seen, but not these pairs
HELD_OUT = [(COLOUR_NAMES[k % len(COLOURS)], SHAPE_NOUNS[k]) for k in range(len(SHAPE_NOUNS))]
PHRASINGS = ["a {colour} {shape}", "a {size} {colour} {shape}", "a {colour} {shape} on the {side}",
             "a {size} {colour} {shape} on the {side}", "a photo of a {colour} {shape}",
             "there is a {size} {shape} in {colour} on the {side}", "the {shape} is {colour}"]
SHAPE_TEMPLATES = ["a {}", "a photo of a {}"]            # zero-shot prompts; {} is e.g. "red circle"


def shape_classnames():
    """The K = 60 colour-shape combinations, "red circle", ..., class c = colour * 10 + shape."""
    return [f"{colour} {shape}" for colour in COLOUR_NAMES for shape in SHAPE_NOUNS]


def _draw_captioned_shapes(n, rng, S, allowed):
    """n images uint8 (n, S, S, 3), their captions and classes, with classes drawn from allowed (K',)."""
    classes = allowed[rng.integers(0, len(allowed), size=n)]                    # (n,) colour * 10 + shape
    colour, shape = classes // len(SHAPE_NOUNS), classes % len(SHAPE_NOUNS)    # (n,) each
    size = rng.integers(0, len(SIZES), size=n)                                 # (n,) 0 small, 1 large
    side = rng.integers(0, len(SIDES), size=n)                                 # (n,) 0 left, 1 right
    phrasing = rng.integers(0, len(PHRASINGS), size=n)                         # (n,)
    rgb = numpy.array(list(COLOURS.values()), dtype=numpy.float32)[colour]     # (n, 3)
    fg = numpy.clip(rgb + rng.uniform(-20, 20, size=(n, 3)), 0, 255)           # (n, 3)
    bounds = numpy.array(list(SIZES.values()), dtype=numpy.float32)[size]      # (n, 2)
    radius = rng.uniform(bounds[:, 0], bounds[:, 1]) * S                       # (n,) pixels
    middle = S / 2
    lo = numpy.where(side == 0, radius, middle + 1.5)                          # (n,) centre x from lo to hi
    hi = numpy.where(side == 0, middle - 1.5, S - radius)
    cx = lo + rng.uniform(0, 1, size=n) * numpy.maximum(hi - lo, 0)            # (n,)
    images = _draw_shape_images(shape, rng, S, fg=fg.reshape(n, 1, 1, 3).astype(numpy.float32),
                                  radius=radius.reshape(n, 1, 1).astype(numpy.float32),
                                  cx=cx.reshape(n, 1, 1).astype(numpy.float32))
    names = list(SIZES)
    texts = [PHRASINGS[p].format(colour=COLOUR_NAMES[c], shape=SHAPE_NOUNS[k], size=names[s], side=SIDES[d])
             for p, c, k, s, d in zip(phrasing, colour, shape, size, side)]
    return images, texts, classes.astype(numpy.int64)


def make_captioned_shapes(num_train=10000, num_test=3000, seed=0, img_size=32):
    """Captioned shapes: training images only of the 50 seen colour-shape combinations, test images of
    all 60 (so about 1/6 of them are held-out combinations). Returns a CaptionedDataset."""
    for name, value in (("num_train", num_train), ("num_test", num_test), ("seed", seed), ("img_size", img_size)):
        if not isinstance(value, (int, numpy.integer)) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_train < 1 or num_test < 1:
        raise ValueError(f"num_train and num_test must be >= 1, got {num_train} and {num_test}")
    if img_size < 16:
        raise ValueError(f"img_size must be at least 16 pixels (a small shape on one side), got {img_size}")
    classnames = shape_classnames()
    held_out = sorted(classnames.index(f"{c} {s}") for c, s in HELD_OUT)
    seen = numpy.array([k for k in range(len(classnames)) if k not in held_out])
    train_seq, test_seq = numpy.random.SeedSequence(int(seed)).spawn(2)
    x_train, text_train, y_train = _draw_captioned_shapes(int(num_train), numpy.random.default_rng(train_seq),
                                                          int(img_size), seen)
    x_test, text_test, y_test = _draw_captioned_shapes(int(num_test), numpy.random.default_rng(test_seq),
                                                       int(img_size), numpy.arange(len(classnames)))
    mean, std = D.channel_mean_std(x_train)
    return CaptionedDataset("shapes", x_train, text_train, y_train, x_test, text_test, y_test, classnames,
                            list(SHAPE_TEMPLATES), held_out, mean, std)


# ---- Fashion-MNIST, captioned from its class names --------------------------------------------------

FASHION_NOUNS = ["t-shirt", "pair of trousers", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                 "ankle boot"]                       # data.FASHION_MNIST_CLASSES as a caption says them
FASHION_PHRASINGS = ["a {noun}", "a photo of a {noun}", "a {shade} {noun}", "a photo of a {shade} {noun}",
                     "a black and white photo of a {noun}", "a picture of a {shade} {noun}"]
FASHION_TEMPLATES = ["a {}", "a photo of a {}"]


def caption_fashion(x, y, rng):
    """Captions for Fashion-MNIST images x uint8 (N, 28, 28, 1) of classes y (N,): the class name and the
    image's shade, "dark" or "light" (its mean over the garment's pixels below or above the median
    of its class), in one of FASHION_PHRASINGS drawn from rng. Returns N str."""
    ink = x.reshape(len(x), -1).astype(numpy.float32)                          # (N, H*W*C)
    mean_ink = (ink * (ink > 0)).sum(1) / numpy.maximum((ink > 0).sum(1), 1)   # (N,) the garment's mean
    dark = numpy.zeros(len(x), dtype=bool)
    for k in numpy.unique(y):
        sel = y == k
        dark[sel] = mean_ink[sel] < numpy.median(mean_ink[sel])
    phrasing = rng.integers(0, len(FASHION_PHRASINGS), size=len(x))
    return [FASHION_PHRASINGS[p].format(noun=FASHION_NOUNS[k], shade="dark" if d else "light")
            for p, k, d in zip(phrasing, y, dark)]


def make_captioned_fashion(root=None, seed=0):
    """Fashion-MNIST (minivit.data.load_fashion_mnist) with captions; zero-shot over its ten classes."""
    (x_train, y_train), (x_test, y_test) = D.load_fashion_mnist(root)
    train_seq, test_seq = numpy.random.SeedSequence(int(seed)).spawn(2)
    text_train = caption_fashion(x_train, y_train, numpy.random.default_rng(train_seq))
    text_test = caption_fashion(x_test, y_test, numpy.random.default_rng(test_seq))
    return CaptionedDataset("fashion-mnist", x_train, text_train, y_train, x_test, text_test, y_test,
                            list(FASHION_NOUNS), list(FASHION_TEMPLATES), [], D.FASHION_MNIST_MEAN,
                            D.FASHION_MNIST_STD)


CAPTIONED_DATASETS = ("shapes", "fashion-mnist")


def load_captioned(name, data_dir=None, seed=0):
    """A CaptionedDataset by name: "shapes" (generated) or "fashion-mnist" (data_dir: its folder)."""
    if name not in CAPTIONED_DATASETS:
        raise ValueError(f"unknown captioned data set {name!r}; choose one of {CAPTIONED_DATASETS}")
    if name == "shapes":
        return make_captioned_shapes(seed=seed)
    return make_captioned_fashion(data_dir, seed=seed)


def tokenizer_for(data, context_length=16):
    """The Tokenizer of a CaptionedDataset: every word of its training captions and of its zero-shot
    prompts (each template filled with each class name)."""
    prompts = [t.format(name) for name in data.classnames for t in data.templates]
    return Tokenizer.from_captions(list(data.text_train) + prompts, context_length)


# ---------------------------------------------------------------------------------------------------
# Batches without two identical captions
# ---------------------------------------------------------------------------------------------------


def caption_ids(texts):
    """int64 (N,): the same id for the same caption text."""
    _, ids = numpy.unique(numpy.asarray(texts, dtype=object).astype(str), return_inverse=True)
    return ids.astype(numpy.int64).reshape(-1)


def batch_indices(step, batch_size, seed, ids):
    """The training pairs of optimizer step `step`, (B,) indices into the N pairs, no two with the same
    caption. A function of (seed, step) alone, as the trainer's batches are (exact resume): epoch
    e = step // (N // B) is a permutation seeded with (seed, e), cut into batches; a pair whose caption is
    already in its batch is replaced by one drawn at random (seeded with (seed, step)) whose caption is not.
    ids: int64 (N,) from caption_ids. A batch larger than the number of distinct captions is refused."""
    N = ids.shape[0]
    distinct = int(numpy.unique(ids).size)
    if batch_size > distinct:
        raise ValueError(f"batch_size {batch_size} is more than the {distinct} distinct captions: a batch "
                         f"cannot avoid holding a caption twice (a false negative)")
    epoch, i = divmod(step, N // batch_size)
    idx = host_rng([seed, epoch]).permutation(N)[i * batch_size:(i + 1) * batch_size]   # (B,)
    rng = host_rng([seed, 2_000_003, step])
    taken = set()
    for slot, j in enumerate(idx):
        while ids[j] in taken:                       # a caption seen already in this batch: draw another
            j = int(rng.integers(N))
        idx[slot] = j
        taken.add(ids[j])
    return idx
