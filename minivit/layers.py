"""The layers a student composes and modifies: thin classes over the pairs in functional.py.

The contract every layer keeps:
- ``params`` and ``grads`` map names to arrays, with the same keys (timm's names, e.g. ``"weight"``,
  ``"bias"``). A layer puts its own arrays there (``self.params["gamma"] = ...``, which also makes the
  zeroed ``grads["gamma"]``) and its sublayers into attributes (``self.norm1 = LayerNorm(D)``, a list of
  them in a LayerList); both views then list every array of the tree under dotted names
  (``"attn.qkv.weight"``), read from the layers each time, so they are never stale: replace a sublayer
  (``blk.norm1 = RMSNorm(D)``, ``model.blocks[3] = MyBlock(...)``) or add a parameter, and the optimizers,
  ``state_dict``, ``num_params``, ``to``, ``zero_grad`` and data parallel use it with no other call.
  Change parameters in place (``p -= lr * g``), never by rebinding an entry.
- ``forward(x)`` returns the output and, in training mode, keeps in ``self.cache`` what backward needs.
  In eval mode (``layer.eval()``) it keeps nothing, so inference holds no activations.
- ``backward(dout)`` returns the gradient with respect to the input and ADDS the parameter gradients
  into ``self.grads`` (as PyTorch adds into ``.grad``). Call ``zero_grad()`` before each backward;
  two backwards without it accumulate, which is how gradient accumulation works.

Each layer calls its pair of functional.py, the math. For linear, LayerNorm, GELU and attention it calls
it through the dispatch, minivit/fast/ops.py, which may run a faster twin from minivit/fast/ instead, but
only one it has checked against functional.py as it stands (so an edit there is what runs). Whatever you
write in a layer's forward or backward here, or in a layer class of your own, is what runs.

How an image becomes tokens (PatchEmbed, PosEmbed, GridPosEmbed, Embedding) is in embeddings.py, built on these.
"""

from collections.abc import MutableMapping

from . import functional as F
from .fast import ops
from .backend import asarray, backend_module, backend_of, get_array_module, host_rng, is_array


def trunc_normal(rng, shape, std, dtype):
    """Values from N(0, std^2) truncated to [-2 std, 2 std] (redrawn when outside), on the current backend.
    Drawn on the host with rng (a numpy Generator), so a seed gives the same model on NumPy and CuPy."""
    values = rng.standard_normal(shape)
    flat = values.reshape(-1)
    redraw = ((flat > 2.0) | (flat < -2.0)).nonzero()[0]       # indices outside [-2, 2]
    while redraw.size:
        new = rng.standard_normal(redraw.size)
        flat[redraw] = new
        redraw = redraw[(new > 2.0) | (new < -2.0)]
    return asarray(values * std, dtype=dtype)


def zeros(shape, dtype):
    return backend_module().zeros(shape, dtype=dtype)


def ones(shape, dtype):
    return backend_module().ones(shape, dtype=dtype)


class Parameters(MutableMapping):
    """A layer's ``params`` (or ``grads``), live: its own arrays first, then every sublayer's under its
    dotted name ("attn.qkv.weight"), read from the layers each time it is used. Nothing is copied or
    cached, so the view cannot go stale: a parameter put into any layer, a sublayer swapped in, a block
    replaced in ``model.blocks`` is in ``model.params`` at once, and so in what the optimizers train,
    ``state_dict`` saves, ``num_params`` counts, ``to`` moves and ``zero_grad`` zeroes.

    Writing ``layer.params[name] = array`` puts the array into the layer that owns ``name`` (a sublayer's,
    for a dotted name), and gives a new parameter its gradient buffer (zeros, same shape) when it has none."""

    def __init__(self, layer, kind):
        self._layer, self._kind = layer, kind        # kind: "params" or "grads"

    def _own(self, layer=None):
        return (layer or self._layer).__dict__["_" + self._kind]

    def _locate(self, name):
        """(the dict that holds name, its key there), or None: own arrays first, then each sublayer's."""
        layer = self._layer
        while True:
            own = self._own(layer)
            if name in own:
                return own, name
            for prefix, child in layer.children.items():
                if not prefix:                       # registered with an empty prefix: its names are ours
                    found = Parameters(child, self._kind)._locate(name)
                    if found:
                        return found
                elif name.startswith(prefix + "."):
                    found = Parameters(child, self._kind)._locate(name[len(prefix) + 1:])
                    if found:
                        return found
            return None

    def _walk(self, layer, prefix):
        """(full name, array) for every array, own first, then each sublayer's in order."""
        for key, value in self._own(layer).items():
            yield prefix + key, value
        for name, child in layer.children.items():
            yield from self._walk(child, f"{prefix}{name}." if name else prefix)

    def _flat(self):
        flat = {}
        for name, value in self._walk(self._layer, ""):
            if name in flat:
                raise ValueError(f"two {self._kind} of {type(self._layer).__name__} are both named {name!r} "
                                 f"(a layer's own array and a sublayer's): rename one")
            flat[name] = value
        return flat

    def __getitem__(self, name):
        found = self._locate(name) if isinstance(name, str) else None
        if found is None:
            raise KeyError(name)
        store, key = found
        return store[key]

    def __setitem__(self, name, value):
        if not is_array(value):
            raise TypeError(f"{type(self._layer).__name__}.{self._kind}[{name!r}] must be a numpy or cupy array, "
                            f"got {type(value).__name__}")
        found = self._locate(name) if isinstance(name, str) else None
        if found is not None:                        # an existing array, here or in a sublayer: rebind it there
            store, key = found
            store[key] = value
            return
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"a layer's own {self._kind} are named without dots (the dots separate sublayers), "
                             f"got {name!r}")
        self._own()[name] = value                    # a new array of this layer
        grads = self._layer.__dict__["_grads"]
        if self._kind == "params" and (name not in grads or grads[name].shape != value.shape):
            grads[name] = get_array_module(value).zeros_like(value)   # its gradient buffer, zeroed

    def __delitem__(self, name):
        found = self._locate(name) if isinstance(name, str) else None
        if found is None:
            raise KeyError(name)
        store, key = found
        del store[key]
        if self._kind == "params":                   # a parameter goes with its gradient
            Parameters(self._layer, "grads").pop(name, None)

    def __iter__(self):
        return iter(self._flat())

    def __len__(self):
        return len(self._flat())

    def __contains__(self, name):
        return isinstance(name, str) and self._locate(name) is not None

    def keys(self):
        return self._flat().keys()

    def values(self):
        return self._flat().values()

    def items(self):
        return self._flat().items()

    def __eq__(self, other):
        return dict(self.items()) == other if isinstance(other, dict) else NotImplemented

    def __repr__(self):
        return "{" + ", ".join(f"{k!r}: {tuple(v.shape)}" for k, v in self.items()) + "}"


class Layer:
    """Base class: parameter bookkeeping, train/eval mode and moving between backends.

    A layer puts its own arrays in ``self.params`` / ``self.grads`` (a leaf's "weight", a composite's own
    "gamma"), and its sublayers into attributes (``self.norm1 = LayerNorm(D)``): a Layer put into an
    attribute is registered under the attribute's name, and one put into an attribute that held a
    sublayer takes that sublayer's place and name. ``add(name, layer)`` registers under another name
    (the ViT's PosEmbed goes under "" so that its "cls_token" is a top-level name, as in timm).
    ``params`` and ``grads`` are then live views of the whole tree (class Parameters above).
    """

    def __init__(self):
        object.__setattr__(self, "children", {})   # name -> sub-layer, in forward order
        self._params = {}     # this layer's own parameter arrays, name -> array
        self._grads = {}      # name -> gradient array, same shape, filled by backward
        self.cache = None     # what backward needs, set by forward in training mode
        self.training = True

    @property
    def params(self):
        """name -> parameter array, this layer's and every sublayer's (live: see class Parameters)."""
        if "_params" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() before using params")
        return Parameters(self, "params")

    @params.setter
    def params(self, arrays):
        self.__dict__["_params"] = {}
        view = self.params
        for name, value in dict(arrays).items():
            view[name] = value

    @property
    def grads(self):
        """name -> gradient array, the same names and shapes as params (live)."""
        if "_grads" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() before using grads")
        return Parameters(self, "grads")

    @grads.setter
    def grads(self, arrays):
        self.__dict__["_grads"] = {}
        view = self.grads
        for name, value in dict(arrays).items():
            view[name] = value

    def __setattr__(self, name, value):
        children = self.__dict__.get("children")
        if children is not None and name != "children":
            old = self.__dict__.get(name)
            slot = next((k for k, c in children.items() if c is old), None) if isinstance(old, Layer) else None
            if isinstance(value, Layer):
                if slot is not None:
                    children[slot] = value           # swapped in: the new layer takes the old one's name
                elif not any(c is value for c in children.values()):
                    children[name] = value           # a new sublayer, named after the attribute
            elif value is None and slot is not None:
                del children[slot]                   # `self.norm_pre = None` removes the sublayer
        object.__setattr__(self, name, value)

    def add(self, name, layer):
        """Register layer under name (its arrays are then listed as "name.weight"...) and return it. A layer
        already registered under name is replaced, and every attribute that held it now holds the new one."""
        if not isinstance(name, str):
            raise TypeError(f"a sublayer's name must be a str, got {name!r}")
        if not isinstance(layer, Layer):
            raise TypeError(f"add({name!r}, ...) takes a minivit Layer, got {type(layer).__name__}")
        old = self.children.get(name)
        self.children[name] = layer
        if old is not None and old is not layer:
            for attr, value in list(self.__dict__.items()):
                if value is old:
                    object.__setattr__(self, attr, layer)
                elif isinstance(value, LayerList):
                    value._replace_in_place(old, layer)
        return layer

    def named_sublayers(self, prefix=""):
        """(name, layer) for this layer and every layer inside it, depth first: the one walk over a model
        (checkpoints name dropout layers by it, gradcheck and the profiler find layers with it). A name is
        the prefix of the layer's parameters, "blocks.0.attn"; this layer is ``prefix`` ("" by default)."""
        yield prefix, self
        for name, child in self.children.items():
            yield from child.named_sublayers(".".join(part for part in (prefix, name) if part))

    def sublayers(self):
        """This layer and every layer inside it, depth first (named_sublayers without the names)."""
        return (layer for _, layer in self.named_sublayers())

    def zero_grad(self):
        for g in self.grads.values():
            g[...] = 0

    def train(self, mode=True):
        self.training = mode
        if not mode:
            self.cache = None
        for child in self.children.values():
            child.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def to(self, backend):
        """Move every parameter and gradient to 'numpy' or 'cupy' (caches are dropped)."""
        for child in self.children.values():
            child.to(backend)
        for kind in ("_params", "_grads"):
            self.__dict__[kind] = {k: asarray(v, backend=backend) for k, v in self.__dict__[kind].items()}
        self.cache = None
        return self

    def _need_cache(self):
        if self.cache is None:
            raise RuntimeError(f"{type(self).__name__}.backward called without a forward in training mode: "
                               "call forward first, and train() if the layer was put in eval mode")
        return self.cache

    def __repr__(self):
        return f"{type(self).__name__}({self.extra_repr()})"

    def extra_repr(self):
        return ""


class LayerList(list):
    """A list of sublayers that stays registered: ``model.blocks``. Its layers are the owner's sublayers
    "blocks.0", "blocks.1", ... in list order, and every change to the list (``model.blocks[1] = MyBlock(...)``,
    append, insert, del, pop) renames and re-registers them, so model.params follows at once."""

    def __init__(self, owner, prefix, layers=()):
        super().__init__(layers)
        self.owner, self.prefix = owner, prefix
        self._sync()

    def __reduce_ex__(self, protocol):        # copy/deepcopy/pickle: rebuilt with its owner, no sync needed
        return _rebuild_layer_list, (self.owner, self.prefix, list(self))

    def _sync(self):
        """Make the owner's children "prefix.i" the list's layers, where the old ones stood in the order."""
        for i, layer in enumerate(self):
            if not isinstance(layer, Layer):
                raise TypeError(f"{self.prefix}[{i}] must be a minivit Layer, got {type(layer).__name__}")
        children, start = self.owner.children, self.prefix + "."
        old = list(children.items())
        at = next((i for i, (k, _) in enumerate(old) if k.startswith(start)), len(old))
        kept = [(k, v) for k, v in old if not k.startswith(start)]
        at = sum(1 for k, _ in old[:at] if not k.startswith(start))
        mine = [(f"{start}{i}", layer) for i, layer in enumerate(self)]
        children.clear()
        children.update(kept[:at] + mine + kept[at:])

    def _replace_in_place(self, old, new):
        for i, layer in enumerate(self):
            if layer is old:
                list.__setitem__(self, i, new)

    def _changed(method):
        def changed(self, *args, **kwargs):
            result = getattr(list, method)(self, *args, **kwargs)
            self._sync()
            return result
        changed.__name__ = method
        return changed

    for _method in ("__setitem__", "__delitem__", "__iadd__", "append", "extend", "insert", "pop", "remove",
                    "clear", "reverse", "sort"):
        locals()[_method] = _changed(_method)
    del _method, _changed


def _rebuild_layer_list(owner, prefix, layers):
    rebuilt = LayerList.__new__(LayerList)
    list.extend(rebuilt, layers)
    rebuilt.owner, rebuilt.prefix = owner, prefix
    return rebuilt


class Linear(Layer):
    """y = x W + b, with W stored (in_features, out_features) so the code reads as the math."""

    def __init__(self, in_features, out_features, bias=True, rng=None, dtype="float32", std=0.02):
        super().__init__()
        rng = host_rng(0) if rng is None else rng
        self.in_features, self.out_features = in_features, out_features
        self.params["weight"] = trunc_normal(rng, (in_features, out_features), std, dtype)  # (in, out)
        self.grads["weight"] = zeros((in_features, out_features), dtype)
        if bias:
            self.params["bias"] = zeros((out_features,), dtype)                         # (out,)
            self.grads["bias"] = zeros((out_features,), dtype)
        self.matmul_dtype = None  # "float16": mixed precision (set by model.set_matmul_dtype, minivit/fast/amp.py)

    def forward(self, x):  # x: (..., in) -> (..., out)
        y, cache = ops.linear_forward(x, self.params["weight"], self.params.get("bias"), self.matmul_dtype)
        self.cache = cache if self.training else None
        return y

    def backward(self, dout):  # dout: (..., out) -> dx: (..., in)
        dx, dweight, dbias = ops.linear_backward(dout, self._need_cache())
        self.grads["weight"] += dweight
        if "bias" in self.grads:
            self.grads["bias"] += dbias
        return dx

    def extra_repr(self):
        mixed = "" if self.matmul_dtype is None else f", matmul {self.matmul_dtype}"
        return f"{self.in_features} -> {self.out_features}, bias={'bias' in self.params}{mixed}"


class LayerNorm(Layer):
    """Normalise each token over its D features, then scale and shift (eps 1e-6, as ViT; CLIP: 1e-5)."""

    def __init__(self, dim, eps=1e-6, dtype="float32"):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.params["weight"] = ones((dim,), dtype)   # (D,)  gamma
        self.params["bias"] = zeros((dim,), dtype)    # (D,)  beta
        self.grads["weight"] = zeros((dim,), dtype)
        self.grads["bias"] = zeros((dim,), dtype)

    def forward(self, x):  # (..., D) -> (..., D)
        out, cache = ops.layernorm_forward(x, self.params["weight"], self.params["bias"], self.eps)
        self.cache = cache if self.training else None
        return out

    def backward(self, dout):
        dx, dweight, dbias = ops.layernorm_backward(dout, self._need_cache())
        self.grads["weight"] += dweight
        self.grads["bias"] += dbias
        return dx

    def extra_repr(self):
        return f"{self.dim}, eps={self.eps}"


class GELU(Layer):
    """gelu(x) = x Phi(x); approximate="erf" (exact, timm), "tanh" (the JAX checkpoints) or "quick"
    (x sigmoid(1.702 x), OpenAI's CLIP)."""

    def __init__(self, approximate="erf"):
        super().__init__()
        F.check_gelu(approximate)
        self.approximate = approximate

    def forward(self, x):
        out, cache = ops.gelu_forward(x, self.approximate)
        self.cache = cache if self.training else None
        return out

    def backward(self, dout):
        return ops.gelu_backward(dout, self._need_cache())

    def extra_repr(self):
        return repr(self.approximate)


class Dropout(Layer):
    """Zero each value with probability p in training (scaling the rest by 1/(1-p)); identity in eval.
    ``per_sample=True`` drops whole samples instead: that is drop-path (stochastic depth), applied to a
    residual branch so the block is skipped for that sample.

    The masks come from ``self.rng``, a host generator whose state checkpoints save, so a resumed run draws
    the same masks as an uninterrupted one. On the CPU it draws every value of the mask. On the GPU it
    draws one seed per call and the GPU expands the seed into the mask (ops.dropout_keep_mask: one
    launch, no copy from the host). So a GPU run is reproducible on the GPU (same seed, same masks, resumed
    or not), but its masks are not the CPU run's: the two draw different random numbers."""

    def __init__(self, p=0.0, per_sample=False, seed=0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
        self.p, self.per_sample = p, per_sample
        self.rng = host_rng(seed)  # a host generator: its state is saved in checkpoints

    def forward(self, x):
        if not self.training or self.p == 0.0:
            self.cache = None
            return x
        shape = (x.shape[0],) + (1,) * (x.ndim - 1) if self.per_sample else x.shape
        if backend_of(x) == "numpy":
            keep = self.rng.random(shape) >= self.p                              # (B, 1, 1) or x's shape
        else:
            keep = ops.dropout_keep_mask(shape, self.p, int(self.rng.integers(2 ** 63)))      # on the GPU
        out, self.cache = F.dropout_forward(x, keep, self.p)
        return out

    def backward(self, dout):
        if self.p == 0.0 or not self.training:
            return dout
        return F.dropout_backward(dout, self._need_cache())

    def extra_repr(self):
        return f"p={self.p}" + (", per_sample" if self.per_sample else "")


class MLP(Layer):
    """The transformer's feed-forward net: fc1 (D -> M), GELU, fc2 (M -> D)."""

    def __init__(self, dim, hidden_dim, gelu="erf", drop=0.0, rng=None, dtype="float32", seed=0):
        super().__init__()
        self.fc1 = Linear(dim, hidden_dim, rng=rng, dtype=dtype)
        self.act = GELU(gelu)
        self.fc2 = Linear(hidden_dim, dim, rng=rng, dtype=dtype)
        self.drop = Dropout(drop, seed=seed)

    def forward(self, x):                        # (B, N, D)
        h = self.act.forward(self.fc1.forward(x))  # (B, N, M)
        return self.drop.forward(self.fc2.forward(h))  # (B, N, D)

    def backward(self, dout):                    # (B, N, D)
        dh = self.fc2.backward(self.drop.backward(dout))  # (B, N, M)
        return self.fc1.backward(self.act.backward(dh))   # (B, N, D)


def check_num_heads(dim, num_heads):
    """The heads rule, for Attention and for ViTConfig: D splits into nh heads of hs = D / nh features."""
    if dim % num_heads:
        raise ValueError(f"embed_dim {dim} must be divisible by num_heads {num_heads} "
                         f"(each head gets embed_dim / num_heads features)")


class Attention(Layer):
    """Multi-head self-attention: qkv = x W_qkv (one packed projection), per-head softmax(q k^T / sqrt(hs)) v,
    heads concatenated and projected back to D. ``forward(x, mask)``: an additive (N, N) mask, e.g.
    functional.causal_mask(x) for a text Transformer (None: every token reads every token)."""

    def __init__(self, dim, num_heads, qkv_bias=True, drop=0.0, rng=None, dtype="float32", seed=0):
        super().__init__()
        check_num_heads(dim, num_heads)
        self.num_heads = num_heads
        self.qkv = Linear(dim, 3 * dim, bias=qkv_bias, rng=rng, dtype=dtype)
        self.proj = Linear(dim, dim, rng=rng, dtype=dtype)
        self.drop = Dropout(drop, seed=seed)

    def forward(self, x, mask=None):                                 # (B, N, D)
        qkv = self.qkv.forward(x)                                    # (B, N, 3D)
        ctx, cache = ops.attention_forward(qkv, self.num_heads, mask)  # (B, N, D)
        self.cache = cache if self.training else None
        return self.drop.forward(self.proj.forward(ctx))             # (B, N, D)

    def backward(self, dout):                                        # (B, N, D)
        dctx = self.proj.backward(self.drop.backward(dout))          # (B, N, D)
        dqkv = ops.attention_backward(dctx, self._need_cache())        # (B, N, 3D)
        return self.qkv.backward(dqkv)                               # (B, N, D)

    @property
    def attn(self):
        """The last forward's attention weights (B, nh, N, N), for plots (training mode only)."""
        return None if self.cache is None else ops.attention_weights(self.cache)

    def extra_repr(self):
        return f"heads={self.num_heads}"


class Block(Layer):
    """The pre-norm transformer block, paper Eqs. 2-3:
        x1  = x  + attn(norm1(x))        z'_l = MSA(LN(z_{l-1})) + z_{l-1}
        out = x1 + mlp(norm2(x1))        z_l  = MLP(LN(z'_l)) + z'_l
    drop_path > 0 randomly skips a sample's residual branches in training (stochastic depth).
    ``forward(x, mask)`` passes an additive attention mask on to attn (CLIP's text tower: causal)."""

    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=True, gelu="erf", drop=0.0, drop_path=0.0,
                 rng=None, dtype="float32", seed=0, eps=1e-6):
        super().__init__()
        self.norm1 = LayerNorm(dim, eps=eps, dtype=dtype)
        self.attn = Attention(dim, num_heads, qkv_bias, drop, rng=rng, dtype=dtype, seed=seed)
        self.norm2 = LayerNorm(dim, eps=eps, dtype=dtype)
        self.mlp = MLP(dim, int(dim * mlp_ratio), gelu, drop, rng=rng, dtype=dtype, seed=seed + 1)
        self.drop_path1 = Dropout(drop_path, per_sample=True, seed=seed + 2)
        self.drop_path2 = Dropout(drop_path, per_sample=True, seed=seed + 3)

    def forward(self, x, mask=None):                                         # (B, N, D)
        h = self.norm1.forward(x)
        # mask (N, N), e.g. the text tower's causal one; without it attn is called as forward(h), so that an
        # attention a student writes with forward(self, x) (lesson 10) still runs in the ViT
        a = self.attn.forward(h) if mask is None else self.attn.forward(h, mask)   # (B, N, D)
        x1 = x + self.drop_path1.forward(a)                                  # (B, N, D)
        return x1 + self.drop_path2.forward(self.mlp.forward(self.norm2.forward(x1)))  # (B, N, D)

    def backward(self, dout):                                                # (B, N, D)
        # out = x1 + mlp(norm2(x1)): the residual passes dout straight through, plus the branch
        dx1 = dout + self.norm2.backward(self.mlp.backward(self.drop_path2.backward(dout)))
        # x1 = x + attn(norm1(x))
        return dx1 + self.norm1.backward(self.attn.backward(self.drop_path1.backward(dx1)))


POOL_MODES = ("cls", "gap")


def check_pool(mode):
    """The pooling rule, for Pool and for ViTConfig.pool."""
    if mode not in POOL_MODES:
        raise ValueError(f"pool must be 'cls' or 'gap', got {mode!r}")


class Pool(Layer):
    """From tokens to one vector per image. "cls": the class token's output (paper Eq. 4);
    "gap": the mean over the patch tokens (the model then has no class token).

    num_prefix_tokens=T (timm's name): the tokens before the patches, the class token and the register
    tokens. "gap" averages only the N patch tokens after them, as timm's global_pool="avg" (x[:, T:]);
    "cls" reads token 0 whatever T is. The registers' outputs are read by neither mode: they are dropped
    here, and get zero gradient from the pool (they still shape the other tokens through attention)."""

    def __init__(self, mode="cls", num_prefix_tokens=0):
        super().__init__()
        check_pool(mode)
        self.mode, self.num_prefix_tokens = mode, num_prefix_tokens

    def forward(self, x):                       # (B, T+N, D) -> (B, D)
        self.cache = x.shape if self.training else None
        if self.mode == "cls":
            return x[:, 0]                      # y = z^0, the class token
        return x[:, self.num_prefix_tokens:].mean(1)   # y = 1/N sum_i z^(T+i), the patch tokens only

    def backward(self, dout):                   # (B, D) -> (B, T+N, D)
        B, S, D = self._need_cache()            # S = T + N tokens
        T = self.num_prefix_tokens
        xp = get_array_module(dout)
        dx = xp.zeros((B, S, D), dtype=dout.dtype)  # the tokens not read get no gradient
        if self.mode == "cls":
            dx[:, 0] = dout                     # only the class token was read
        else:
            dx[:, T:] = dout[:, None, :] / (S - T)  # the mean spreads 1/N to each patch token
        return dx

    def extra_repr(self):
        skip = self.mode == "gap" and self.num_prefix_tokens        # only the mean skips the prefix
        return repr(self.mode) + (f", num_prefix_tokens={self.num_prefix_tokens}" if skip else "")


class Tanh(Layer):
    """out = tanh(x), elementwise; no parameters."""

    def forward(self, x):
        out, cache = F.tanh_forward(x)
        self.cache = cache if self.training else None
        return out

    def backward(self, dout):
        return F.tanh_backward(dout, self._need_cache())


class PreLogits(Layer):
    """The representation layer of the pre-training head ("MLP with one hidden layer", paper §3.1):
    y -> tanh(y W + b), D -> R, between the pooled token and the head. timm's name: pre_logits.fc.
    Fine-tuning drops it and puts a single zero-initialised linear head in its place."""

    def __init__(self, dim, representation_size, rng=None, dtype="float32"):
        super().__init__()
        self.fc = Linear(dim, representation_size, rng=rng, dtype=dtype)
        self.act = Tanh()

    def forward(self, x):                        # (B, D)
        return self.act.forward(self.fc.forward(x))   # (B, R)

    def backward(self, dout):                    # (B, R)
        return self.fc.backward(self.act.backward(dout))  # (B, D)


# The layers that make the tokens (patches, class token, position embeddings, token ids) moved to
# embeddings.py, which builds on this file: an old `layers.PosEmbed` says where to look.
MOVED_TO_EMBEDDINGS = ("PatchEmbed", "prepend_tokens_forward", "prepend_tokens_backward", "PosEmbed",
                       "resize_pos_embed", "_linear_resize", "POS_EMBED_KINDS", "check_pos_embed", "sincos2d_table",
                       "GridPosEmbed", "Embedding")


def __getattr__(name):
    if name in MOVED_TO_EMBEDDINGS:
        raise AttributeError(f"{name} moved to minivit.embeddings: use minivit.embeddings.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
