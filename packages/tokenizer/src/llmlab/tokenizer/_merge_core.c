/* The merge loop of llmlab.tokenizer.merge_trainer, compiled.
 *
 * Why: in Python every merge costs about 2 us per word it rewrites (fetch the word, str.replace,
 * update the pair counts, note the word under each new pair); HF tokenizers' BpeTrainer does the
 * same work in Rust, so the interpreted loop could not reach HF's training speed on the
 * SentencePiece-BPE and end-of-word corpora. This file is the same algorithm as
 * merge_trainer._train + _merge_few, step for step, so it learns the same merges in the same
 * order (tests/tokenizer/test_merge_paths.py compares the two on random corpora, and every
 * trainer's HF-equality test runs on it):
 *
 * - words are arrays of symbol ids with a count; a pair (a, b) is the 64-bit key a << 32 | b;
 * - counts[p] is the count-weighted number of occurrences of p; where[p] lists the words that
 *   may hold p (the words that held it initially, and those in which a merge made it; entries
 *   may be stale and are re-checked);
 * - a lazy max-queue gives the best pair: the highest count, ties to the smaller (a, b). An entry
 *   whose count no longer matches counts[p] is re-queued with the true count when popped. Only
 *   pairs containing the new symbol can grow, so only those get fresh entries after a merge;
 * - a merge rewrites each candidate word left to right, non-overlapping (str.replace's rule),
 *   and updates only the neighbourhood of each new symbol n: "L a b" -> "L n" turns (L, a) into
 *   (L, n) -- (b, a) into (n, n) when L is itself n --, and "a b R" -> "n R" turns (b, R) into
 *   (n, R). When n was already in the word (a merge that re-made an existing token), the word is
 *   recounted whole.
 *
 * The token values (and whether a merge re-makes an existing token) are the caller's business:
 * train() calls new_token(a, b) once per merge and gets the merged token's id back.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EMPTY UINT64_MAX
#define SURROGATES 0xD800u
#define SHIFT 0x800u /* merge_trainer.id_char skips the surrogate block */

typedef struct {
    int32_t *items;
    int32_t len, cap;
} IntVec;

static int vec_push(IntVec *v, int32_t x) {
    if (v->len == v->cap) {
        int32_t cap = v->cap ? 2 * v->cap : 4;
        int32_t *items = realloc(v->items, (size_t)cap * sizeof(int32_t));
        if (!items) return -1;
        v->items = items;
        v->cap = cap;
    }
    v->items[v->len++] = x;
    return 0;
}

/* Pair key -> count, candidate words, and the merge at which it last grew (open addressing). */
typedef struct {
    uint64_t *keys;
    int64_t *counts;
    IntVec *where;
    int32_t *grown_at;
    size_t cap, used; /* cap: a power of two, kept at least twice used */
} PairMap;

static inline uint64_t pair_key(uint32_t a, uint32_t b) { return (uint64_t)a << 32 | b; }

static inline size_t mix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return (size_t)k;
}

static size_t map_slot(const PairMap *m, uint64_t key) {
    size_t mask = m->cap - 1, i = mix(key) & mask;
    while (m->keys[i] != EMPTY && m->keys[i] != key) i = (i + 1) & mask;
    return i;
}

static int map_init(PairMap *m, size_t cap) {
    m->cap = cap;
    m->used = 0;
    m->keys = malloc(cap * sizeof(uint64_t));
    m->counts = malloc(cap * sizeof(int64_t));
    m->where = calloc(cap, sizeof(IntVec));
    m->grown_at = malloc(cap * sizeof(int32_t));
    if (!m->keys || !m->counts || !m->where || !m->grown_at) return -1;
    memset(m->keys, 0xff, cap * sizeof(uint64_t));
    return 0;
}

static void map_free(PairMap *m) {
    if (m->where)
        for (size_t i = 0; i < m->cap; i++) free(m->where[i].items);
    free(m->keys);
    free(m->counts);
    free(m->where);
    free(m->grown_at);
}

static int map_grow(PairMap *m) {
    PairMap bigger;
    if (map_init(&bigger, 2 * m->cap) < 0) {
        map_free(&bigger);
        return -1;
    }
    for (size_t i = 0; i < m->cap; i++) {
        if (m->keys[i] == EMPTY) continue;
        size_t j = map_slot(&bigger, m->keys[i]);
        bigger.keys[j] = m->keys[i];
        bigger.counts[j] = m->counts[i];
        bigger.where[j] = m->where[i];
        bigger.grown_at[j] = m->grown_at[i];
    }
    bigger.used = m->used;
    m->where = memset(m->where, 0, m->cap * sizeof(IntVec)); /* moved, not freed */
    map_free(m);
    *m = bigger;
    return 0;
}

/* The slot of key, inserted with count 0 when absent; -1 when out of memory. */
static Py_ssize_t map_insert(PairMap *m, uint64_t key) {
    size_t i = map_slot(m, key);
    if (m->keys[i] != EMPTY) return (Py_ssize_t)i;
    if (2 * (m->used + 1) > m->cap) {
        if (map_grow(m) < 0) return -1;
        i = map_slot(m, key);
    }
    m->keys[i] = key;
    m->counts[i] = 0;
    m->where[i] = (IntVec){0};
    m->grown_at[i] = -1;
    m->used++;
    return (Py_ssize_t)i;
}

static Py_ssize_t map_find(const PairMap *m, uint64_t key) {
    size_t i = map_slot(m, key);
    return m->keys[i] == EMPTY ? -1 : (Py_ssize_t)i;
}

/* The merge queue: the highest count first, ties to the smaller key (= the smaller (a, b)). */
typedef struct {
    int64_t count;
    uint64_t key;
} Entry;

typedef struct {
    Entry *items;
    size_t len, cap;
} Heap;

static inline int before(Entry x, Entry y) {
    return x.count > y.count || (x.count == y.count && x.key < y.key);
}

static int heap_push(Heap *h, Entry e) {
    if (h->len == h->cap) {
        size_t cap = h->cap ? 2 * h->cap : 1024;
        Entry *items = realloc(h->items, cap * sizeof(Entry));
        if (!items) return -1;
        h->items = items;
        h->cap = cap;
    }
    size_t i = h->len++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!before(e, h->items[parent])) break;
        h->items[i] = h->items[parent];
        i = parent;
    }
    h->items[i] = e;
    return 0;
}

static Entry heap_pop(Heap *h) {
    Entry top = h->items[0], last = h->items[--h->len];
    size_t i = 0;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= h->len) break;
        if (child + 1 < h->len && before(h->items[child + 1], h->items[child])) child++;
        if (!before(h->items[child], last)) break;
        h->items[i] = h->items[child];
        i = child;
    }
    if (h->len) h->items[i] = last;
    return top;
}

/* Everything one training run holds. */
typedef struct {
    uint32_t *sym;   /* every word's symbols, end to end */
    Py_ssize_t *start;
    int32_t *len;    /* shrinks as merges rewrite the word in place */
    int64_t *count;
    int32_t *stamp;  /* the merge that last visited the word (candidates repeat) */
    Py_ssize_t n_words;
    PairMap pairs;
    Heap heap;
    uint64_t *grown; /* the pairs that grew in the current merge */
    size_t n_grown, cap_grown;
    int32_t merge_no;
} Trainer;

static void trainer_free(Trainer *t) {
    free(t->sym);
    free(t->start);
    free(t->len);
    free(t->count);
    free(t->stamp);
    map_free(&t->pairs);
    free(t->heap.items);
    free(t->grown);
}

/* counts[p] += delta for word w; a pair that grows is noted (once per merge), and w filed under
 * it, when it contains n (only those pairs can be new to w). */
static int add_pair(Trainer *t, uint64_t key, int64_t delta, int32_t w, int track) {
    Py_ssize_t s = map_insert(&t->pairs, key);
    if (s < 0) return -1;
    PairMap *m = &t->pairs;
    m->counts[s] += delta;
    if (!track) return 0;
    IntVec *v = &m->where[s];
    if ((v->len == 0 || v->items[v->len - 1] != w) && vec_push(v, w) < 0) return -1;
    if (m->grown_at[s] != t->merge_no) {
        m->grown_at[s] = t->merge_no;
        if (t->n_grown == t->cap_grown) {
            size_t cap = t->cap_grown ? 2 * t->cap_grown : 256;
            uint64_t *g = realloc(t->grown, cap * sizeof(uint64_t));
            if (!g) return -1;
            t->grown = g;
            t->cap_grown = cap;
        }
        t->grown[t->n_grown++] = key;
    }
    return 0;
}

static int sub_pair(Trainer *t, uint64_t key, int64_t delta) {
    Py_ssize_t s = map_find(&t->pairs, key);
    if (s < 0) {
        PyErr_Format(PyExc_RuntimeError, "merge core: pair (%u, %u) lost but never counted",
                     (unsigned)(key >> 32), (unsigned)(key & 0xffffffffu));
        return -1;
    }
    t->pairs.counts[s] -= delta;
    return 0;
}

/* Rewrite word w, in which (a, b) occurs from position `at` on, with n; update the counts. */
static int merge_word(Trainer *t, int32_t w, Py_ssize_t at, uint32_t a, uint32_t b, uint32_t n,
                      int reused) {
    uint32_t *s = t->sym + t->start[w];
    int32_t old_len = t->len[w];
    int64_t c = t->count[w];
    int recount = 0;
    if (reused)
        for (int32_t i = 0; i < old_len && !recount; i++) recount = s[i] == n;
    if (recount) /* the word held n already: take all its pairs out, put the new ones back */
        for (int32_t i = 0; i + 1 < old_len; i++)
            if (sub_pair(t, pair_key(s[i], s[i + 1]), c) < 0) return -1;
    Py_ssize_t out = at;
    for (Py_ssize_t i = at; i < old_len;) {
        if (i + 1 < old_len && s[i] == a && s[i + 1] == b) {
            s[out++] = n;
            i += 2;
        } else {
            s[out++] = s[i++];
        }
    }
    int32_t last = (int32_t)out - 1;
    t->len[w] = (int32_t)out;
    if (recount) {
        for (int32_t i = 0; i < last; i++) {
            int has_n = s[i] == n || s[i + 1] == n;
            if (add_pair(t, pair_key(s[i], s[i + 1]), c, w, has_n) < 0) return -1;
        }
        return 0;
    }
    for (int32_t j = (int32_t)at; j <= last; j++) {
        if (s[j] != n) continue;
        if (j > 0) {
            uint32_t left = s[j - 1];
            if (sub_pair(t, left == n ? pair_key(b, a) : pair_key(left, a), c) < 0) return -1;
            if (add_pair(t, pair_key(left, n), c, w, 1) < 0) return -1;
        }
        if (j < last && s[j + 1] != n) {
            if (sub_pair(t, pair_key(b, s[j + 1]), c) < 0) return -1;
            if (add_pair(t, pair_key(n, s[j + 1]), c, w, 1) < 0) return -1;
        }
    }
    return 0;
}

/* Apply the merge of `key` into n to every candidate word; queue the pairs that grew. */
static int apply_merge(Trainer *t, uint64_t key, uint32_t n, int reused) {
    uint32_t a = (uint32_t)(key >> 32), b = (uint32_t)(key & 0xffffffffu);
    Py_ssize_t slot = map_find(&t->pairs, key);
    IntVec candidates = t->pairs.where[slot];
    t->pairs.where[slot] = (IntVec){0};
    t->n_grown = 0;
    int rc = 0;
    for (int32_t k = 0; k < candidates.len && rc == 0; k++) {
        int32_t w = candidates.items[k];
        if (t->stamp[w] == t->merge_no) continue;
        t->stamp[w] = t->merge_no;
        const uint32_t *s = t->sym + t->start[w];
        int32_t len = t->len[w];
        Py_ssize_t at = 0;
        while (at + 1 < len && !(s[at] == a && s[at + 1] == b)) at++;
        if (at + 1 < len) rc = merge_word(t, w, at, a, b, n, reused);
    }
    free(candidates.items);
    if (rc < 0) return -1;
    t->pairs.counts[map_find(&t->pairs, key)] = 0; /* the pair is gone from every word */
    for (size_t k = 0; k < t->n_grown; k++) {
        Py_ssize_t s = map_find(&t->pairs, t->grown[k]);
        if (heap_push(&t->heap, (Entry){t->pairs.counts[s], t->grown[k]}) < 0) return -1;
    }
    return 0;
}

/* Read the words (one character per symbol id, merge_trainer.spell) and their counts. */
static int load_words(Trainer *t, PyObject *words, PyObject *counts) {
    Py_ssize_t n = PyList_GET_SIZE(words), total = 0;
    if (!PyList_Check(counts) || PyList_GET_SIZE(counts) != n) {
        PyErr_SetString(PyExc_ValueError, "counts must be a list as long as words");
        return -1;
    }
    if (n > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "at most %d distinct words, got %zd", INT32_MAX, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *w = PyList_GET_ITEM(words, i);
        if (!PyUnicode_Check(w)) {
            PyErr_Format(PyExc_TypeError, "words[%zd] must be a str", i);
            return -1;
        }
        total += PyUnicode_GET_LENGTH(w);
    }
    t->n_words = n;
    t->sym = malloc((size_t)(total ? total : 1) * sizeof(uint32_t));
    t->start = malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    t->len = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    t->count = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    t->stamp = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    if (!t->sym || !t->start || !t->len || !t->count || !t->stamp) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *w = PyList_GET_ITEM(words, i);
        Py_ssize_t len = PyUnicode_GET_LENGTH(w);
        if (len > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "words[%zd] is too long (%zd symbols)", i, len);
            return -1;
        }
        int kind = PyUnicode_KIND(w);
        const void *data = PyUnicode_DATA(w);
        t->start[i] = pos;
        t->len[i] = (int32_t)len;
        t->stamp[i] = -1;
        for (Py_ssize_t j = 0; j < len; j++) {
            Py_UCS4 ch = PyUnicode_READ(kind, data, j);
            t->sym[pos++] = ch >= SURROGATES ? ch - SHIFT : ch;
        }
        long long c = PyLong_AsLongLong(PyList_GET_ITEM(counts, i));
        if (c == -1 && PyErr_Occurred()) return -1;
        t->count[i] = c;
    }
    return 0;
}

/* The initial pair counts, candidate lists and queue. */
static int count_pairs(Trainer *t) {
    size_t cap = 1024;
    while (cap < 4 * (size_t)t->n_words) cap *= 2;
    if (map_init(&t->pairs, cap) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t w = 0; w < t->n_words; w++) {
        const uint32_t *s = t->sym + t->start[w];
        for (int32_t i = 0; i + 1 < t->len[w]; i++) {
            Py_ssize_t slot = map_insert(&t->pairs, pair_key(s[i], s[i + 1]));
            if (slot < 0) return -1;
            t->pairs.counts[slot] += t->count[w];
            IntVec *v = &t->pairs.where[slot];
            if ((v->len == 0 || v->items[v->len - 1] != (int32_t)w) && vec_push(v, (int32_t)w) < 0)
                return -1;
        }
    }
    for (size_t i = 0; i < t->pairs.cap; i++)
        if (t->pairs.keys[i] != EMPTY && t->pairs.counts[i] > 0)
            if (heap_push(&t->heap, (Entry){t->pairs.counts[i], t->pairs.keys[i]}) < 0) return -1;
    return 0;
}

static PyObject *merge_loop(Trainer *t, Py_ssize_t n_tokens, Py_ssize_t vocab_size,
                            long long min_frequency, PyObject *new_token) {
    PyObject *merges = PyList_New(0);
    if (!merges) return NULL;
    while (n_tokens < vocab_size && t->heap.len > 0) {
        Entry top = heap_pop(&t->heap);
        Py_ssize_t slot = map_find(&t->pairs, top.key);
        int64_t current = slot < 0 ? 0 : t->pairs.counts[slot];
        if (top.count != current) { /* stale entry: re-queue with the true count */
            if (current > 0 && heap_push(&t->heap, (Entry){current, top.key}) < 0) goto nomem;
            continue;
        }
        if (current < 1 || current < min_frequency) break;
        uint32_t a = (uint32_t)(top.key >> 32), b = (uint32_t)(top.key & 0xffffffffu);
        PyObject *id = PyObject_CallFunction(new_token, "II", a, b);
        if (!id) goto error;
        Py_ssize_t n = PyLong_AsSsize_t(id);
        Py_DECREF(id);
        if (n == -1 && PyErr_Occurred()) goto error;
        if (n < 0 || n > n_tokens || n > (Py_ssize_t)(0x110000 - SHIFT)) {
            PyErr_Format(PyExc_ValueError, "new_token returned id %zd; expected 0..%zd", n,
                         n_tokens);
            goto error;
        }
        int reused = n < n_tokens;
        if (!reused) n_tokens++;
        PyObject *merge = Py_BuildValue("(II)", a, b);
        if (!merge || PyList_Append(merges, merge) < 0) {
            Py_XDECREF(merge);
            goto error;
        }
        Py_DECREF(merge);
        t->merge_no++;
        if (apply_merge(t, top.key, (uint32_t)n, reused) < 0) goto nomem;
    }
    return merges;
nomem:
    if (!PyErr_Occurred()) PyErr_NoMemory();
error:
    Py_DECREF(merges);
    return NULL;
}

PyDoc_STRVAR(train_doc,
"train(words, counts, n_tokens, vocab_size, min_frequency, new_token) -> list of (a, b)\n\n"
"Learn merges until there are vocab_size tokens (n_tokens exist already) or no pair occurs at\n"
"least max(min_frequency, 1) times. words: one character per symbol id (merge_trainer.spell);\n"
"counts: their frequencies. new_token(a, b) returns the merged token's id: n_tokens for a new\n"
"token (then n_tokens grows by one), or the id of the existing token it re-makes.");

static PyObject *train(PyObject *self, PyObject *args) {
    PyObject *words, *counts, *new_token;
    Py_ssize_t n_tokens, vocab_size;
    long long min_frequency;
    if (!PyArg_ParseTuple(args, "O!OnnLO:train", &PyList_Type, &words, &counts, &n_tokens,
                          &vocab_size, &min_frequency, &new_token))
        return NULL;
    if (!PyCallable_Check(new_token)) {
        PyErr_SetString(PyExc_TypeError, "new_token must be callable");
        return NULL;
    }
    Trainer t = {0};
    PyObject *merges = NULL;
    if (load_words(&t, words, counts) == 0 && count_pairs(&t) == 0)
        merges = merge_loop(&t, n_tokens, vocab_size, min_frequency, new_token);
    else if (!PyErr_Occurred())
        PyErr_NoMemory();
    trainer_free(&t);
    return merges;
}

static PyMethodDef methods[] = {
    {"train", train, METH_VARARGS, train_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_merge_core",
    "The compiled merge loop of llmlab.tokenizer.merge_trainer (same merges, in C).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__merge_core(void) { return PyModule_Create(&module); }
