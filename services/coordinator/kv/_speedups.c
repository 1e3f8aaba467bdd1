/* The request path of kv_aware in C: a chat's token ids, their chained block hashes, and the
 * run of them an endpoint's shared table holds; and the per-block work of following the
 * engines' events into the index and the shared tables.
 *
 * Why C: between two requests (or two batches of events) the machine's other processes evict
 * the Coordinator's CPU caches, and work made of Python objects and bytecode then costs several
 * times what it costs in a tight loop (bench/results/kv_routing.md). These steps touch only
 * flat memory here, or Python's containers without the interpreter's dispatch per item.
 *
 * Each function has a Python reference that defines it and that the tests compare it with:
 *   chat_ids        motor_mesh.common.tokenizer.Builtin and sim_chat_text (the simulated
 *                   engine's tokenizer and chat lines)
 *   Chats.prompt    chain(chat_ids(messages)), remembered by conversation prefix
 *   chain           motor_mesh.coordinator.kv.hashing.chain (CPython's int and tuple hashes)
 *   unpack_ids      msgspec's decoding of a msgpack array as list[int] (wire._ids_of: a
 *                   BlockStored's token ids, read only to be hashed)
 *   held            motor_mesh.coordinator.kv.shared.Table.has with speedups.held_run
 *   holder          motor_mesh.coordinator.kv.shared.SharedReader.holder's Python loop
 *   place           motor_mesh.coordinator.kv.prompt.place over holder
 *   Prompts         motor_mesh.coordinator.kv.routing.KvRouting._read with Tokens.prompt's chats
 *   Chooser         motor_mesh.coordinator.kv.policy.KvAware.choose (nothing excluded, no endpoint
 *                   down)
 *   table_update    motor_mesh.coordinator.kv.shared.Table.update (the management process's
 *                   writes, an event's changes at once)
 *   hold, release   motor_mesh.coordinator.kv.speedups.hold and .release (KvIndex's loops over an
 *                   event's blocks)
 * The module is optional: without a C compiler Motor runs those references instead.
 */
/* One file, one translation unit: the compiler inlines across its sections (the hashing into the
 * memo's loop, the probing into the lookups), which separate files would stop without LTO. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AES_FOLD 1 /* the chat memo's keys from AES rounds where the CPU has them (see Chats) */
#endif

/* -- zlib's CRC-32 (Builtin's token id is crc32(word) % vocab) ----------------------------- */

static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

/* -- growable buffers ------------------------------------------------------------------------ */

/* Room in *v (n items of `size` bytes, *cap allocated) for one more. */
static int grow(void **v, Py_ssize_t n, Py_ssize_t *cap, size_t size) {
    if (n < *cap)
        return 0;
    Py_ssize_t more = *cap ? *cap * 2 : 64;
    void *bigger = PyMem_Realloc(*v, (size_t)more * size);
    if (!bigger) {
        PyErr_NoMemory();
        return -1;
    }
    *v = bigger;
    *cap = more;
    return 0;
}

/* A growable array of T, and the function that appends to it. */
#define VECTOR(Name, T, push)                                      \
    typedef struct {                                               \
        T *v;                                                      \
        Py_ssize_t n, cap;                                         \
    } Name;                                                        \
    static int push(Name *a, T x) {                                \
        if (grow((void **)&a->v, a->n, &a->cap, sizeof(T)) < 0)    \
            return -1;                                             \
        a->v[a->n++] = x;                                          \
        return 0;                                                  \
    }

VECTOR(Ids, int32_t, ids_push)    /* token ids */
VECTOR(Hashes, int64_t, hashes_push) /* block hashes */

static int ids_extend(Ids *ids, const int32_t *v, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (ids_push(ids, v[i]) < 0)
            return -1;
    return 0;
}

/* -- the built-in tokenizer: str.split() words, each crc32(utf-8, surrogatepass) % vocab ---- */

/* The CRC of the current word runs as its bytes come: no copy of the word, and a word may
 * continue across strings ("<role>" and ":" are one word). */
typedef struct {
    uint32_t crc; /* of the current word's UTF-8 so far, not yet inverted */
    Py_ssize_t n; /* its bytes */
    uint32_t vocab;
    Ids *out;
} Words;

#define WORDS(vocab, out) {0xFFFFFFFFu, 0, (vocab), (out)}

static inline void words_byte(Words *s, unsigned char b) {
    s->crc = crc_table[(s->crc ^ b) & 0xFF] ^ (s->crc >> 8);
    s->n++;
}

static inline int words_flush(Words *s) {
    if (!s->n)
        return 0;
    int32_t id = (int32_t)((s->crc ^ 0xFFFFFFFFu) % s->vocab);
    s->crc = 0xFFFFFFFFu;
    s->n = 0;
    return ids_push(s->out, id);
}

static int words_char(Words *s, Py_UCS4 ch) {
    if (Py_UNICODE_ISSPACE(ch))
        return words_flush(s);
    /* UTF-8; a lone surrogate as its three bytes, as "surrogatepass" writes it */
    if (ch < 0x80) {
        words_byte(s, (unsigned char)ch);
    } else if (ch < 0x800) {
        words_byte(s, (unsigned char)(0xC0 | (ch >> 6)));
        words_byte(s, (unsigned char)(0x80 | (ch & 0x3F)));
    } else if (ch < 0x10000) {
        words_byte(s, (unsigned char)(0xE0 | (ch >> 12)));
        words_byte(s, (unsigned char)(0x80 | ((ch >> 6) & 0x3F)));
        words_byte(s, (unsigned char)(0x80 | (ch & 0x3F)));
    } else {
        words_byte(s, (unsigned char)(0xF0 | (ch >> 18)));
        words_byte(s, (unsigned char)(0x80 | ((ch >> 12) & 0x3F)));
        words_byte(s, (unsigned char)(0x80 | ((ch >> 6) & 0x3F)));
        words_byte(s, (unsigned char)(0x80 | (ch & 0x3F)));
    }
    return 0;
}

static int words_str(Words *s, PyObject *str) {
    int kind = PyUnicode_KIND(str);
    const void *data = PyUnicode_DATA(str);
    Py_ssize_t len = PyUnicode_GET_LENGTH(str);
    if (kind == PyUnicode_1BYTE_KIND && PyUnicode_IS_ASCII(str)) {
        /* ASCII is its own UTF-8: each byte goes into the CRC as it is. */
        const unsigned char *p = data;
        for (Py_ssize_t i = 0; i < len; i++) {
            if (Py_UNICODE_ISSPACE(p[i])) {
                if (words_flush(s) < 0)
                    return -1;
            } else
                words_byte(s, p[i]);
        }
        return 0;
    }
    for (Py_ssize_t i = 0; i < len; i++)
        if (words_char(s, PyUnicode_READ(kind, data, i)) < 0)
            return -1;
    return 0;
}

static PyObject *str_role, *str_content, *str_colon, *str_empty, *array_type;

/* A chat message as the simulated engine reads it: a dict with a str role and a str or null
 * content (borrowed references). 1: read; 0: not such a message (the caller leaves the chat to
 * Python); -1: an error is set. */
static int read_message(PyObject *m, PyObject **role, PyObject **text) {
    if (!PyDict_Check(m))
        return 0;
    *role = PyDict_GetItemWithError(m, str_role);
    if (!*role)
        return PyErr_Occurred() ? -1 : 0;
    *text = PyDict_GetItemWithError(m, str_content);
    if (!*text && PyErr_Occurred())
        return -1;
    if (!*text || *text == Py_None)
        *text = str_empty;
    if (!PyUnicode_Check(*role) || !PyUnicode_Check(*text))
        return 0;
    if (PyUnicode_READY(*role) < 0 || PyUnicode_READY(*text) < 0)
        return -1;
    return 1;
}

/* Append the ids of the message's "<role>: <text>" line. */
static int message_ids(Words *words, PyObject *role, PyObject *text) {
    if (words_str(words, role) < 0 || words_str(words, str_colon) < 0 || words_str(words, text) < 0)
        return -1;
    return words_flush(words);
}

static PyObject *new_array(const char *typecode, const void *data, size_t bytes) {
    /* (y# would pass None for a NULL pointer: an empty buffer never allocated) */
    return PyObject_CallFunction(array_type, "sy#", typecode, data ? (const char *)data : "", (Py_ssize_t)bytes);
}

PyDoc_STRVAR(chat_ids_doc,
             "chat_ids(messages, vocab) -> array('i') | None\n\n"
             "The simulated engine's token ids of a chat: each message's \"<role>: <text>\" line\n"
             "tokenized by the built-in tokenizer, one line after the other. None when a message\n"
             "is not a dict with a str role and a str or null content (the caller reads those).");

/* The ids of a chat into `out`: 1, or 0 when a message is not one read_message reads, or -1. */
static int read_chat(PyObject *messages, uint32_t vocab, Ids *out) {
    if (!PyList_Check(messages) || PyList_GET_SIZE(messages) == 0)
        return 0;
    Words words = WORDS(vocab, out);
    int rc = 1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(messages) && rc == 1; i++) {
        PyObject *role, *text;
        rc = read_message(PyList_GET_ITEM(messages, i), &role, &text);
        if (rc == 1 && message_ids(&words, role, text) < 0)
            rc = -1;
    }
    return rc;
}

/* read_chat's ids as array('i'), None when it reads no chat. */
static PyObject *chat_ids_of(PyObject *messages, uint32_t vocab) {
    Ids out = {0};
    int rc = read_chat(messages, vocab, &out);
    PyObject *result = rc < 0   ? NULL
                       : rc == 0 ? Py_NewRef(Py_None)
                                 : new_array("i", out.v, (size_t)out.n * sizeof(int32_t));
    PyMem_Free(out.v);
    return result;
}

static PyObject *sp_chat_ids(PyObject *mod, PyObject *args) {
    PyObject *messages;
    unsigned long vocab;
    if (!PyArg_ParseTuple(args, "Ok", &messages, &vocab))
        return NULL;
    if (vocab == 0 || vocab > 0x7FFFFFFFul) {
        PyErr_SetString(PyExc_ValueError, "vocab must be in 1..2**31-1");
        return NULL;
    }
    return chat_ids_of(messages, (uint32_t)vocab);
}

/* -- chained block hashes: hash((parent, tuple(block))) as CPython computes it ---------------- */

#define MODULUS ((uint64_t)0x1FFFFFFFFFFFFFFFull) /* 2**61 - 1, CPython's int hash modulus */
#define XXPRIME_1 11400714785074694791ull
#define XXPRIME_2 14029467366897019727ull
#define XXPRIME_5 2870177450012600261ull

/* hash(int(v)): |v| mod 2**61 - 1 with v's sign, -1 made -2 */
static uint64_t int_hash(int64_t v) {
    uint64_t a = v < 0 ? 0 - (uint64_t)v : (uint64_t)v;
    a = (a & MODULUS) + (a >> 61);
    if (a >= MODULUS)
        a -= MODULUS;
    int64_t h = v < 0 ? -(int64_t)a : (int64_t)a;
    return (uint64_t)(h == -1 ? -2 : h);
}

static inline uint64_t xx_lane(uint64_t acc, uint64_t lane) {
    acc += lane * XXPRIME_2;
    acc = (acc << 31) | (acc >> 33);
    return acc * XXPRIME_1;
}

static inline uint64_t xx_end(uint64_t acc, uint64_t len) {
    acc += len ^ (XXPRIME_5 ^ 3527539ull);
    return acc == (uint64_t)-1 ? 1546275796ull : acc;
}


/* The hash of one block chained to its parent's: hash((parent, tuple(ids))). */
static uint64_t block_hash(uint64_t parent, const void *ids, int wide, Py_ssize_t bs) {
    uint64_t acc = XXPRIME_5;
    for (Py_ssize_t i = 0; i < bs; i++)
        acc = xx_lane(acc, int_hash(wide ? ((const int64_t *)ids)[i] : ((const int32_t *)ids)[i]));
    uint64_t block = xx_end(acc, (uint64_t)bs);
    return xx_end(xx_lane(xx_lane(XXPRIME_5, int_hash((int64_t)parent)), block), 2);
}

/* The chained hashes of the full blocks of n ids (int64 if wide, else int32) as array('q'). */
static PyObject *chain_of(const void *ids, Py_ssize_t n, int wide, Py_ssize_t bs, uint64_t parent) {
    Py_ssize_t blocks = n / bs;
    int64_t *out = PyMem_Malloc((size_t)blocks * sizeof(int64_t) + 1);
    if (!out)
        return PyErr_NoMemory();
    for (Py_ssize_t b = 0; b < blocks; b++)
        out[b] = (int64_t)(parent = block_hash(parent, (const char *)ids + b * bs * (wide ? 8 : 4), wide, bs));
    PyObject *result = new_array("q", out, (size_t)blocks * sizeof(int64_t));
    PyMem_Free(out);
    return result;
}

/* -- Chats: a chat's block hashes, remembered by the conversation so far ----------------------
 *
 * Each turn of a conversation resends every earlier message, and an application's
 * conversations start with the same system prompt. So the block hashes of every prefix of
 * messages seen are remembered (per block size), keyed by a 128-bit hash of those messages,
 * and a request tokenizes and hashes only the messages after the longest prefix remembered.
 * Keying reads the request's own texts, which it has just parsed; a hit then reads a few
 * hundred bytes of remembered hashes, where comparing the texts with remembered copies, or
 * re-hashing a 1,000-token system prompt, read kilobytes that other processes had evicted
 * from the CPU caches. The key is seeded per process: no text can be made to take another's
 * place, and 128 bits do not collide by chance. A set-associative cache: a full set drops its
 * least recently used turn, and past the byte budget a sweeping hand drops turns until the
 * new one fits. The last message's turn (a new question, on most requests) is remembered when
 * the request's prompt is released, after its answer: the next turn of the conversation needs
 * it, the request itself does not, and allocating and copying it cost the request's path a
 * trip to memory or two. Its prompt's buffer of hashes becomes the turn's. */

#define WAYS 4

typedef struct {
    uint64_t a, b;
} Key;

typedef struct {
    Key key;
    uint64_t used; /* 0: an empty entry */
    Py_ssize_t bs, n, nblocks, ntail;
    int64_t *hashes; /* nblocks hashes, then the ntail int32 ids of the last partial block */
    size_t bytes;
} Turn;

typedef struct {
    PyObject_HEAD
    Turn *turns;
    size_t sets, hand;
    uint64_t tick;
    size_t bytes, max_bytes;
    Py_ssize_t count;
    uint32_t vocab;
    int64_t root;
    Py_ssize_t bs; /* the engines' block size, kept by the Python side (see Prompts) */
} ChatsObject;

static uint64_t seed[4];

#define M0 0x9E3779B97F4A7C15ull
#define M1 0xC2B2AE3D27D4EB4Full
#define M2 0x165667B19E3779F9ull
#define M3 0xD6E8FEB86659FD93ull

static inline uint64_t rd64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint64_t fold(uint64_t h, uint64_t v, uint64_t m) {
    h = (h ^ v) * m;
    return h ^ (h >> 32);
}

static inline uint64_t fmix(uint64_t h) {
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    return h ^ (h >> 33);
}

/* Eight independent lanes, two per constant: each lane's step is a multiply chain several cycles
 * long, and with eight of them in flight the loop runs at the multiplier's throughput (a system
 * prompt of 17 KB is folded on every request). */
#define LANES 8

static void fold_str(uint64_t l[LANES], PyObject *s) {
    const unsigned char *p = PyUnicode_DATA(s);
    size_t n = (size_t)PyUnicode_GET_LENGTH(s) * (size_t)PyUnicode_KIND(s);
    uint64_t a = fold(l[0], (uint64_t)PyUnicode_KIND(s), M0), b = l[1], c = l[2];
    uint64_t d = fold(l[3], (uint64_t)n, M3), e = l[4], f = l[5], g = l[6], h = l[7];
    for (; n >= 64; p += 64, n -= 64) {
        a = fold(a, rd64(p), M0);
        b = fold(b, rd64(p + 8), M1);
        c = fold(c, rd64(p + 16), M2);
        d = fold(d, rd64(p + 24), M3);
        e = fold(e, rd64(p + 32), M0);
        f = fold(f, rd64(p + 40), M1);
        g = fold(g, rd64(p + 48), M2);
        h = fold(h, rd64(p + 56), M3);
    }
    for (; n >= 8; p += 8, n -= 8)
        a = fold(a, rd64(p), M0);
    uint64_t tail = 0;
    memcpy(&tail, p, n);
    l[0] = a;
    l[1] = fold(b, tail, M1);
    l[2] = c;
    l[3] = d;
    l[4] = e;
    l[5] = f;
    l[6] = g;
    l[7] = h;
}

/* The key of the messages so far: `prev`'s and one more message. */
static Key portable_next_key(Key prev, PyObject *role, PyObject *text) {
    uint64_t l[LANES] = {seed[0], seed[1], seed[2], seed[3],
                         seed[0] ^ M2, seed[1] ^ M3, seed[2] ^ M0, seed[3] ^ M1};
    fold_str(l, role);
    fold_str(l, text);
    uint64_t x = l[0] ^ ((l[2] << 23) | (l[2] >> 41)) ^ fmix(l[4] ^ ((l[6] << 29) | (l[6] >> 35)));
    uint64_t y = l[1] ^ ((l[3] << 41) | (l[3] >> 23)) ^ fmix(l[5] ^ ((l[7] << 17) | (l[7] >> 47)));
    uint64_t a = fmix(x), b = fmix(y);
    return (Key){fmix(prev.a * M0 ^ a), fmix(prev.b * M1 ^ b)};
}

/* The same key from AES rounds, where the CPU has them: one round per 16 bytes in each of eight
 * lanes runs at the AES units' throughput, and a system prompt's kilobytes are folded on every
 * request (a memo hit on a 17 KB one: 1.5 µs with the multiplies, 0.8 µs with AES, here). Each
 * block is mixed into a lane's state by a round keyed from the process's seed, the lanes and
 * the previous key then through several more. A process keys its memos with one of the two,
 * chosen once, at import (`_key_fold`). */
#ifdef AES_FOLD
#define AES_TARGET __attribute__((target("aes,sse4.1")))

AES_TARGET static inline __m128i aes_round(__m128i state, __m128i key) {
    return _mm_aesenc_si128(state, key);
}

AES_TARGET static void aes_fold_str(__m128i l[LANES], const __m128i k[4], PyObject *s) {
    const unsigned char *p = PyUnicode_DATA(s);
    size_t n = (size_t)PyUnicode_GET_LENGTH(s) * (size_t)PyUnicode_KIND(s);
    /* The width and length first: a text is not its zero-padded self, nor two texts one. */
    l[0] = aes_round(_mm_xor_si128(l[0], _mm_set_epi64x((long long)PyUnicode_KIND(s), (long long)n)), k[0]);
    for (; n >= 128; p += 128, n -= 128)
        for (int i = 0; i < LANES; i++)
            l[i] = aes_round(_mm_xor_si128(l[i], _mm_loadu_si128((const __m128i *)(p + 16 * i))), k[i & 3]);
    int i = 0; /* fewer than LANES blocks are left: one to each lane, the tail's after them */
    for (; n >= 16; p += 16, n -= 16, i++)
        l[i] = aes_round(_mm_xor_si128(l[i], _mm_loadu_si128((const __m128i *)p)), k[i & 3]);
    if (n) {
        unsigned char tail[16] = {0};
        memcpy(tail, p, n);
        l[i] = aes_round(_mm_xor_si128(l[i], _mm_loadu_si128((const __m128i *)tail)), k[i & 3]);
    }
}

AES_TARGET static Key aes_next_key(Key prev, PyObject *role, PyObject *text) {
    const __m128i k[4] = {_mm_set_epi64x((long long)seed[1], (long long)seed[0]),
                          _mm_set_epi64x((long long)seed[3], (long long)seed[2]),
                          _mm_set_epi64x((long long)(seed[0] ^ M1), (long long)(seed[3] ^ M0)),
                          _mm_set_epi64x((long long)(seed[2] ^ M3), (long long)(seed[1] ^ M2))};
    __m128i l[LANES];
    for (int i = 0; i < LANES; i++)
        l[i] = _mm_xor_si128(k[(i + 1) & 3], _mm_set1_epi64x((long long)(i * M0)));
    aes_fold_str(l, k, role);
    aes_fold_str(l, k, text);
    __m128i acc = _mm_set_epi64x((long long)prev.b, (long long)prev.a);
    for (int i = 0; i < LANES; i++)
        acc = aes_round(_mm_xor_si128(acc, l[i]), k[i & 3]);
    for (int i = 0; i < 4; i++)
        acc = aes_round(acc, k[(i + 2) & 3]);
    return (Key){(uint64_t)_mm_cvtsi128_si64(acc), (uint64_t)_mm_extract_epi64(acc, 1)};
}
#endif

static int aes_keys; /* the memo's keys are aes_next_key's (set once, in the module's init) */

PyDoc_STRVAR(key_fold_doc,
             "_key_fold(name=None) -> str\n\n"
             "Which fold keys the chat memos of this process: 'aes' or 'portable'; with a name,\n"
             "that one from now on (for the tests: keys made by the other are no longer found).");

static PyObject *sp_key_fold(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    const char *now = aes_keys ? "aes" : "portable";
    if (nargs > 1 || (nargs == 1 && args[0] != Py_None && !PyUnicode_Check(args[0]))) {
        PyErr_SetString(PyExc_TypeError, "_key_fold(name=None)");
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None) {
        const char *name = PyUnicode_AsUTF8(args[0]);
        if (!name)
            return NULL;
        if (strcmp(name, "portable") == 0)
            aes_keys = 0;
#ifdef AES_FOLD
        else if (strcmp(name, "aes") == 0 && __builtin_cpu_supports("aes") && __builtin_cpu_supports("sse4.1"))
            aes_keys = 1;
#endif
        else {
            PyErr_Format(PyExc_ValueError, "no key fold %R here", args[0]);
            return NULL;
        }
    }
    return PyUnicode_FromString(now);
}

static Key next_key(Key prev, PyObject *role, PyObject *text) {
#ifdef AES_FOLD
    if (aes_keys)
        return aes_next_key(prev, role, text);
#endif
    return portable_next_key(prev, role, text);
}

static Turn *turn_find(ChatsObject *self, Key k, Py_ssize_t bs) {
    Turn *set = &self->turns[(k.a & (self->sets - 1)) * WAYS];
    for (int w = 0; w < WAYS; w++)
        if (set[w].used && set[w].key.a == k.a && set[w].key.b == k.b && set[w].bs == bs)
            return &set[w];
    return NULL;
}

static void turn_free(ChatsObject *self, Turn *t) {
    if (!t->used)
        return;
    self->bytes -= t->bytes;
    self->count--;
    PyMem_Free(t->hashes);
    memset(t, 0, sizeof(*t));
}

/* Remember the state after the messages keyed `k`: `data` (nblocks hashes, then the ntail ids
 * of the last partial block, `bytes` in all, from PyMem_Malloc) becomes the turn's. A cache:
 * failing to keep it is no error. */
static void turn_adopt(ChatsObject *self, Key k, Py_ssize_t bs, Py_ssize_t n, Py_ssize_t nblocks, Py_ssize_t ntail,
                       int64_t *data, size_t bytes) {
    if (bytes > self->max_bytes) {
        PyMem_Free(data);
        return;
    }
    Turn *set = &self->turns[(k.a & (self->sets - 1)) * WAYS], *victim = &set[0];
    for (int w = 1; w < WAYS && victim->used; w++)
        if (!set[w].used || set[w].used < victim->used)
            victim = &set[w];
    turn_free(self, victim);
    size_t total = self->sets * WAYS;
    for (size_t swept = 0; self->bytes + bytes > self->max_bytes && swept < total; swept++) {
        turn_free(self, &self->turns[self->hand]);
        self->hand = (self->hand + 1) % total;
    }
    *victim = (Turn){k, ++self->tick, bs, n, nblocks, ntail, data, bytes};
    self->bytes += bytes;
    self->count++;
}

/* turn_adopt of a copy of h and tail. */
static void turn_keep(ChatsObject *self, Key k, Py_ssize_t bs, Py_ssize_t n, const Hashes *h, const Ids *tail) {
    size_t bytes = (size_t)h->n * sizeof(int64_t) + (size_t)tail->n * sizeof(int32_t);
    if (bytes > self->max_bytes)
        return;
    int64_t *data = PyMem_Malloc(bytes + 1);
    if (!data)
        return;
    memcpy(data, h->v, (size_t)h->n * sizeof(int64_t));
    memcpy(data + h->n, tail->v, (size_t)tail->n * sizeof(int32_t));
    turn_adopt(self, k, bs, n, h->n, tail->n, data, bytes);
}

/* -- ChatPrompt: what Chats.prompt gives, the prompt.Prompt of a chat the C read -------------- */

typedef struct {
    PyObject_HEAD
    Py_ssize_t n, cached, bs, nblocks;
    Py_ssize_t known;   /* of the blocks, those of the messages the memo knew (sent before) */
    PyObject *endpoint; /* set by kv_aware: the endpoint holding the cached prefix */
    int64_t *hashes;    /* nblocks, at bs */
    PyObject *messages; /* to read the ids again when asked (rarely: tests, another block size) */
    uint32_t vocab;
    int64_t root;
    /* The turn of the chat's last message, kept in `keep_in`'s memo when the prompt is
     * released (after the answer: the next turn needs it, this request does not): its key, and
     * the ids of its last partial block, which follow the hashes in their buffer. */
    ChatsObject *keep_in;
    Key keep_key;
    Py_ssize_t ntail;
} ChatPromptObject;

static PyTypeObject ChatPromptType;

/* Takes h's buffer. With `keep` (the last message's key), the tail's ids are put after the
 * hashes, and the buffer becomes that turn's in the memo when the prompt is released. */
static PyObject *chat_prompt_new(ChatsObject *chats, PyObject *messages, Py_ssize_t n, Py_ssize_t bs, Hashes *h,
                                 Py_ssize_t known, const Key *keep, const Ids *tail) {
    if (keep) {
        /* Room for the tail (fewer ids than a block) after the hashes, as int64s. */
        Py_ssize_t room = h->n + (tail->n + 1) / 2;
        if (room > h->cap) {
            int64_t *bigger = PyMem_Realloc(h->v, (size_t)room * sizeof(int64_t));
            if (!bigger)
                return PyErr_NoMemory();
            h->v = bigger;
            h->cap = room;
        }
        if (tail->n)
            memcpy(h->v + h->n, tail->v, (size_t)tail->n * sizeof(int32_t));
    }
    ChatPromptObject *p = PyObject_New(ChatPromptObject, &ChatPromptType);
    if (!p)
        return NULL;
    p->n = n;
    p->cached = 0;
    p->bs = bs;
    p->nblocks = h->n;
    p->known = known;
    p->hashes = h->v;
    h->v = NULL;
    p->endpoint = Py_NewRef(Py_None);
    p->messages = Py_NewRef(messages);
    p->vocab = chats->vocab;
    p->root = chats->root;
    p->keep_in = keep ? (ChatsObject *)Py_NewRef(chats) : NULL;
    p->keep_key = keep ? *keep : (Key){0, 0};
    p->ntail = keep ? tail->n : 0;
    return (PyObject *)p;
}

static void ChatPrompt_dealloc(ChatPromptObject *p) {
    Py_XDECREF(p->endpoint);
    Py_XDECREF(p->messages);
    if (p->keep_in) {
        size_t bytes = (size_t)p->nblocks * sizeof(int64_t) + (size_t)p->ntail * sizeof(int32_t);
        /* Shrunk to what the memo's budget counts (it had room for more blocks). */
        int64_t *data = PyMem_Realloc(p->hashes, bytes + 1);
        turn_adopt(p->keep_in, p->keep_key, p->bs, p->n, p->nblocks, p->ntail, data ? data : p->hashes, bytes);
        Py_DECREF(p->keep_in);
    } else
        PyMem_Free(p->hashes);
    PyObject_Free(p);
}

static PyObject *ChatPrompt_ids(ChatPromptObject *p, void *closure) {
    return chat_ids_of(p->messages, p->vocab);
}

static PyObject *ChatPrompt_tokens(ChatPromptObject *p, void *closure) {
    PyObject *ids = ChatPrompt_ids(p, NULL);
    PyObject *list = ids ? PySequence_List(ids) : NULL;
    Py_XDECREF(ids);
    return list;
}

static PyObject *ChatPrompt_hashes(ChatPromptObject *p, PyObject *arg) {
    Py_ssize_t bs = PyLong_AsSsize_t(arg);
    if (bs == -1 && PyErr_Occurred())
        return NULL;
    if (bs <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be positive, not %zd", bs);
        return NULL;
    }
    if (bs == p->bs)
        return new_array("q", p->hashes, (size_t)p->nblocks * sizeof(int64_t));
    Ids ids = {0}; /* at another block size: from the ids, read again */
    int rc = read_chat(p->messages, p->vocab, &ids);
    PyObject *out = rc < 0 ? NULL : chain_of(ids.v, rc ? ids.n : 0, 0, bs, (uint64_t)p->root);
    PyMem_Free(ids.v);
    return out;
}

static PyMemberDef ChatPrompt_members[] = {
    {"n", T_PYSSIZET, offsetof(ChatPromptObject, n), READONLY, "tokens"},
    {"cached", T_PYSSIZET, offsetof(ChatPromptObject, cached), 0, "tokens kv_aware expects cached"},
    {"endpoint", T_OBJECT, offsetof(ChatPromptObject, endpoint), 0, "the endpoint holding them"},
    {NULL},
};

static PyGetSetDef ChatPrompt_getset[] = {
    {"ids", (getter)ChatPrompt_ids, NULL, "the token ids, as array('i')", NULL},
    {"tokens", (getter)ChatPrompt_tokens, NULL, "the token ids, as a list", NULL},
    {NULL},
};

static PyMethodDef ChatPrompt_methods[] = {
    {"hashes", (PyCFunction)ChatPrompt_hashes, METH_O, "hashes(block_size) -> array('q'): of the full blocks"},
    {NULL},
};

static PyTypeObject ChatPromptType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "motor_mesh.coordinator.kv._speedups.ChatPrompt",
    .tp_doc = PyDoc_STR("A chat's prompt, as Chats.prompt read it (see prompt.Prompt)."),
    .tp_basicsize = sizeof(ChatPromptObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)ChatPrompt_dealloc,
    .tp_members = ChatPrompt_members,
    .tp_getset = ChatPrompt_getset,
    .tp_methods = ChatPrompt_methods,
};

PyDoc_STRVAR(prompt_doc,
             "prompt(messages, block_size) -> ChatPrompt | None\n\n"
             "The chat as a prompt: its token count and the chained hashes of its full blocks\n"
             "of block_size, what chain(chat_ids(messages, vocab), block_size, root) gives.\n"
             "None when a message is not one chat_ids reads. The state after the last message\n"
             "is remembered when the prompt is released (the others' at once).");

#define STACK_KEYS 32

static int positive_block_size(PyObject *arg, Py_ssize_t *bs) {
    *bs = PyLong_AsSsize_t(arg);
    if (*bs == -1 && PyErr_Occurred())
        return -1;
    if (*bs <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be positive, not %zd", *bs);
        return -1;
    }
    return 0;
}

/* Chats.prompt, its arguments checked. */
static PyObject *chats_read(ChatsObject *self, PyObject *messages, Py_ssize_t bs) {
    if (!PyList_Check(messages) || PyList_GET_SIZE(messages) == 0)
        Py_RETURN_NONE;
    Py_ssize_t m = PyList_GET_SIZE(messages);
    Key stack[STACK_KEYS], *keys = m <= STACK_KEYS ? stack : PyMem_Malloc((size_t)m * sizeof(Key));
    Hashes h = {0};
    Ids tail = {0};
    Words words = WORDS(self->vocab, &tail);
    PyObject *result = NULL, *role, *text;
    if (!keys)
        return PyErr_NoMemory();
    /* The tokenizer's tables, fetched while the messages are folded: the CRC is a chain of
     * lookups, and on a cold request path each line of its table would be a miss of its own. */
    for (size_t at = 0; at < sizeof(crc_table); at += 64)
        __builtin_prefetch((const char *)crc_table + at);
    __builtin_prefetch(_Py_ascii_whitespace);
    __builtin_prefetch(_Py_ascii_whitespace + 64);
    Key k = {seed[0], seed[1]};
    for (Py_ssize_t i = 0; i < m; i++) {
        int rc = read_message(PyList_GET_ITEM(messages, i), &role, &text);
        if (rc <= 0) {
            result = rc < 0 ? NULL : Py_NewRef(Py_None);
            goto done;
        }
        keys[i] = k = next_key(k, role, text);
        /* Its set, fetched while the next messages are folded rather than by the lookups
         * below, one miss after another, on a request path whose caches are cold. */
        const char *set = (const char *)&self->turns[(k.a & (self->sets - 1)) * WAYS];
        for (size_t at = 0; at < WAYS * sizeof(Turn); at += 64)
            __builtin_prefetch(set + at);
    }
    /* From the longest prefix remembered (usually all but the last answer and question). */
    Py_ssize_t j = m - 1;
    Turn *from = NULL;
    for (; j >= 0 && !(from = turn_find(self, keys[j], bs)); j--)
        ;
    Py_ssize_t n = 0;
    uint64_t parent = (uint64_t)self->root;
    if (from) {
        from->used = ++self->tick;
        n = from->n;
        /* In one copy, with room for the blocks that follow. */
        h.cap = from->nblocks + 64;
        if (!(h.v = PyMem_Malloc((size_t)h.cap * sizeof(int64_t)))) {
            PyErr_NoMemory();
            goto done;
        }
        memcpy(h.v, from->hashes, (size_t)from->nblocks * sizeof(int64_t));
        h.n = from->nblocks;
        if (ids_extend(&tail, (const int32_t *)(from->hashes + from->nblocks), from->ntail) < 0)
            goto done;
        if (h.n)
            parent = (uint64_t)h.v[h.n - 1];
    }
    for (Py_ssize_t i = j + 1; i < m; i++) {
        Py_ssize_t before = tail.n;
        if (read_message(PyList_GET_ITEM(messages, i), &role, &text) < 0 || message_ids(&words, role, text) < 0)
            goto done;
        n += tail.n - before;
        Py_ssize_t full = tail.n / bs;
        for (Py_ssize_t b = 0; b < full; b++) {
            parent = block_hash(parent, tail.v + b * bs, 0, bs);
            if (hashes_push(&h, (int64_t)parent) < 0)
                goto done;
        }
        memmove(tail.v, tail.v + full * bs, (size_t)(tail.n - full * bs) * sizeof(int32_t));
        tail.n -= full * bs;
        if (i < m - 1)
            turn_keep(self, keys[i], bs, n, &h, &tail);
    }
    /* The last message's turn is kept when the prompt is released, off the request's path. */
    result = chat_prompt_new(self, messages, n, bs, &h, from ? from->nblocks : 0, j < m - 1 ? &keys[m - 1] : NULL,
                             &tail);
done:
    if (keys != stack)
        PyMem_Free(keys);
    PyMem_Free(h.v);
    PyMem_Free(tail.v);
    return result;
}

static PyObject *Chats_prompt(ChatsObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t bs;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "prompt(messages, block_size)");
        return NULL;
    }
    if (positive_block_size(args[1], &bs) < 0)
        return NULL;
    return chats_read(self, args[0], bs);
}

static PyObject *Chats_block_size_get(ChatsObject *self, void *closure) {
    return PyLong_FromSsize_t(self->bs);
}

static int Chats_block_size_set(ChatsObject *self, PyObject *value, void *closure) {
    Py_ssize_t bs;
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "block_size cannot be deleted");
        return -1;
    }
    if (positive_block_size(value, &bs) < 0)
        return -1;
    self->bs = bs;
    return 0;
}

static PyObject *Chats_count_get(ChatsObject *self, void *closure) {
    return PyLong_FromSsize_t(self->count);
}

static PyObject *Chats_bytes_get(ChatsObject *self, void *closure) {
    return PyLong_FromSize_t(self->bytes);
}

static void chats_clear(ChatsObject *self) {
    if (self->turns) {
        for (size_t i = 0; i < self->sets * WAYS; i++)
            turn_free(self, &self->turns[i]);
        PyMem_Free(self->turns);
        self->turns = NULL;
    }
}

static int Chats_init(ChatsObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"vocab", "max_turns", "max_bytes", "root", NULL};
    unsigned long vocab;
    Py_ssize_t max_turns, max_bytes;
    long long root;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "knnL", kwlist, &vocab, &max_turns, &max_bytes, &root))
        return -1;
    if (vocab == 0 || vocab > 0x7FFFFFFFul || max_turns < WAYS || max_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "vocab must be in 1..2**31-1, max_turns at least 4, max_bytes >= 0");
        return -1;
    }
    chats_clear(self);
    size_t sets = 1;
    while (sets * 2 * WAYS <= (size_t)max_turns)
        sets *= 2;
    self->turns = PyMem_Calloc(sets * WAYS, sizeof(Turn));
    if (!self->turns) {
        PyErr_NoMemory();
        return -1;
    }
    self->sets = sets;
    self->hand = 0;
    self->vocab = (uint32_t)vocab;
    self->max_bytes = (size_t)max_bytes;
    self->root = (int64_t)root;
    self->bytes = 0;
    self->count = 0;
    self->tick = 0;
    self->bs = 16;
    return 0;
}

static void Chats_dealloc(ChatsObject *self) {
    chats_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Chats_methods[] = {
    {"prompt", (PyCFunction)(void (*)(void))Chats_prompt, METH_FASTCALL, prompt_doc},
    {NULL},
};

static PyGetSetDef Chats_getset[] = {
    {"count", (getter)Chats_count_get, NULL, "message sequences remembered", NULL},
    {"bytes", (getter)Chats_bytes_get, NULL, "bytes of hashes and ids remembered", NULL},
    {"block_size", (getter)Chats_block_size_get, (setter)Chats_block_size_set,
     "the block size a Prompts reads chats at (16 until set)", NULL},
    {NULL},
};

static PyTypeObject ChatsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "motor_mesh.coordinator.kv._speedups.Chats",
    .tp_doc = PyDoc_STR("Chats(vocab, max_turns, max_bytes, root): the block hashes of chats, remembered\n"
                        "by the messages so far (at most max_turns sequences, max_bytes in all)."),
    .tp_basicsize = sizeof(ChatsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Chats_init,
    .tp_dealloc = (destructor)Chats_dealloc,
    .tp_methods = Chats_methods,
    .tp_getset = Chats_getset,
};

PyDoc_STRVAR(chain_doc,
             "chain(ids, block_size, parent) -> array('q')\n\n"
             "hashing.chain of a buffer of 32- or 64-bit ids, or of a list of ints (OverflowError\n"
             "for one past 64 bits): the chained hashes of its full blocks, the first chained to\n"
             "parent.");

/* A list's ids as 64-bit ints, read in place: an event's token ids arrive as a list, and
 * building an array of them first cost more than hashing them. */
static PyObject *chain_of_list(PyObject *list, Py_ssize_t bs, uint64_t parent) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    int64_t *ids = PyMem_Malloc((size_t)n * sizeof(int64_t) + 1);
    if (!ids)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        int overflow = 0;
        long long v = PyLong_Check(item) ? PyLong_AsLongLongAndOverflow(item, &overflow) : -1;
        if (!PyLong_Check(item) || overflow) {
            PyMem_Free(ids);
            PyErr_SetString(PyLong_Check(item) ? PyExc_OverflowError : PyExc_TypeError,
                            "ids must be integers of at most 64 bits");
            return NULL;
        }
        ids[i] = v;
    }
    PyObject *result = chain_of(ids, n, 1, bs, parent);
    PyMem_Free(ids);
    return result;
}

static PyObject *sp_chain(PyObject *mod, PyObject *args) {
    PyObject *ids;
    Py_ssize_t bs;
    long long parent;
    if (!PyArg_ParseTuple(args, "OnL", &ids, &bs, &parent))
        return NULL;
    if (bs <= 0)
        return PyErr_Format(PyExc_ValueError, "block_size must be positive, not %zd", bs);
    if (PyList_Check(ids))
        return chain_of_list(ids, bs, (uint64_t)parent);
    Py_buffer buf;
    if (PyObject_GetBuffer(ids, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *result = NULL;
    if (buf.itemsize != 4 && buf.itemsize != 8)
        PyErr_SetString(PyExc_TypeError, "ids must be 32- or 64-bit integers");
    else
        result = chain_of(buf.buf, buf.len / buf.itemsize, buf.itemsize == 8, bs, (uint64_t)parent);
    PyBuffer_Release(&buf);
    return result;
}

/* -- unpack_ids: an event's token ids straight from its msgpack -----------------------------
 *
 * A churning engine's BlockStored carries a thousand token ids, read only to be hashed: made
 * into Python ints by a decoder they cost three times what hashing them does. */

PyDoc_STRVAR(unpack_ids_doc,
             "unpack_ids(packed) -> array('q')\n\n"
             "The msgpack array of integers in packed as 64-bit ids; ValueError if packed is\n"
             "anything else (another type, trailing bytes, a truncated item), OverflowError for\n"
             "an unsigned integer past 2**63 - 1.");

static inline uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

static PyObject *sp_unpack_ids(PyObject *mod, PyObject *arg) {
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *p = buf.buf, *end = p + buf.len;
    PyObject *result = NULL;
    int64_t *ids = NULL;
    uint64_t n;
    if (p < end && (*p & 0xF0) == 0x90)
        n = *p++ & 0x0F;
    else if (end - p >= 3 && *p == 0xDC)
        n = be(p + 1, 2), p += 3;
    else if (end - p >= 5 && *p == 0xDD)
        n = be(p + 1, 4), p += 5;
    else
        goto bad;
    if (n > (uint64_t)(end - p)) /* every item takes a byte at least */
        goto bad;
    ids = PyMem_Malloc((size_t)n * sizeof(int64_t) + 1);
    if (!ids) {
        PyErr_NoMemory();
        goto done;
    }
    for (uint64_t i = 0; i < n; i++) {
        unsigned char c = *p++;
        int width;
        int is_signed;
        if (c <= 0x7F || c >= 0xE0) {
            ids[i] = (int8_t)c;
            continue;
        }
        switch (c) {
        case 0xCC: width = 1, is_signed = 0; break;
        case 0xCD: width = 2, is_signed = 0; break;
        case 0xCE: width = 4, is_signed = 0; break;
        case 0xCF: width = 8, is_signed = 0; break;
        case 0xD0: width = 1, is_signed = 1; break;
        case 0xD1: width = 2, is_signed = 1; break;
        case 0xD2: width = 4, is_signed = 1; break;
        case 0xD3: width = 8, is_signed = 1; break;
        default: goto bad;
        }
        if (end - p < width)
            goto bad;
        uint64_t v = be(p, width);
        p += width;
        if (!is_signed) {
            if (v > (uint64_t)INT64_MAX) {
                PyErr_SetString(PyExc_OverflowError, "an id past 2**63 - 1");
                goto done;
            }
            ids[i] = (int64_t)v;
        } else {
            int shift = 64 - 8 * width; /* sign-extend */
            ids[i] = shift ? (int64_t)(v << shift) >> shift : (int64_t)v;
        }
    }
    if (p != end)
        goto bad;
    result = new_array("q", ids, (size_t)n * sizeof(int64_t));
    goto done;
bad:
    PyErr_SetString(PyExc_ValueError, "not a msgpack array of integers");
done:
    PyMem_Free(ids);
    PyBuffer_Release(&buf);
    return result;
}

/* -- held: the run of a prompt's hashes an endpoint's shared table holds ---------------------- */

/* Table.has: open addressing, linear probing, 0 marks an empty slot (a hash of 0 is kept as 1).
 * The writer is another process: read each slot once, whole (an aligned 64-bit load), and give
 * up after a full lap of a table that a torn read shows with no empty slot. */
static int table_has(const int64_t *slots, uint64_t mask, int64_t h) {
    int64_t key = h ? h : 1;
    uint64_t i = (uint64_t)key & mask;
    for (uint64_t probes = 0; probes <= mask; probes++) {
        int64_t s = __atomic_load_n(&slots[i], __ATOMIC_RELAXED);
        if (s == key)
            return 1;
        if (!s)
            return 0;
        i = (i + 1) & mask;
    }
    return 0;
}

/* The run's end between lo and hi, h[0..lo) known held: by bisection. */
static Py_ssize_t bisect_run(const int64_t *s, uint64_t mask, const int64_t *h, Py_ssize_t lo, Py_ssize_t hi) {
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi + 1) / 2;
        if (table_has(s, mask, h[mid - 1]))
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* The run of h[0..n) the table holds, h[0] first: by bisection, as speedups.held_run. */
static Py_ssize_t run_of(const int64_t *s, uint64_t mask, const int64_t *h, Py_ssize_t n) {
    if (!n || !table_has(s, mask, h[0]))
        return 0;
    if (table_has(s, mask, h[n - 1]))
        return n;
    return bisect_run(s, mask, h, 1, n - 1);
}

/* run_of, trying `guess` first: a chat's blocks that the memo knew (its earlier messages, which
 * the engine was sent before) are usually all held, and those of its new message not, so two
 * probes end the search that bisection takes about log2(n) to; each probe is a cache miss. */
static Py_ssize_t run_of_guess(const int64_t *s, uint64_t mask, const int64_t *h, Py_ssize_t n, Py_ssize_t guess) {
    if (guess <= 0 || guess > n)
        return run_of(s, mask, h, n);
    if (guess < n) /* the second probe's slot, fetched with the first's rather than after it */
        __builtin_prefetch(&s[(uint64_t)(h[guess] ? h[guess] : 1) & mask]);
    if (!table_has(s, mask, h[guess - 1]))
        return bisect_run(s, mask, h, 0, guess - 1);
    if (guess == n || !table_has(s, mask, h[guess]))
        return guess;
    return bisect_run(s, mask, h, guess + 1, n);
}

/* A table's slots, to read, and their mask. */
static int slots_of(PyObject *obj, Py_buffer *slots, uint64_t *mask) {
    if (PyObject_GetBuffer(obj, slots, PyBUF_SIMPLE) < 0)
        return -1;
    Py_ssize_t capacity = slots->len / 8;
    if (slots->len % 8 || capacity == 0 || (capacity & (capacity - 1))) {
        PyBuffer_Release(slots);
        PyErr_SetString(PyExc_ValueError, "slots must be a power of two of 64-bit slots");
        return -1;
    }
    *mask = (uint64_t)capacity - 1;
    return 0;
}

PyDoc_STRVAR(held_doc,
             "held(slots, hashes) -> int\n\n"
             "How many of hashes, from the first, the table over slots (a power of two of 64-bit\n"
             "slots) holds: 0 when it lacks the first, else the run found by bisection, as\n"
             "speedups.held_run does.");

static PyObject *sp_held(PyObject *mod, PyObject *args) {
    PyObject *slots_obj;
    Py_buffer slots, hashes;
    uint64_t mask;
    if (!PyArg_ParseTuple(args, "Oy*", &slots_obj, &hashes))
        return NULL;
    PyObject *result = NULL;
    if (hashes.len % 8)
        PyErr_SetString(PyExc_ValueError, "hashes must be 64-bit");
    else if (slots_of(slots_obj, &slots, &mask) == 0) {
        result = PyLong_FromSsize_t(run_of(slots.buf, mask, hashes.buf, hashes.len / 8));
        PyBuffer_Release(&slots);
    }
    PyBuffer_Release(&hashes);
    return result;
}

static PyObject *str_base, *str_down, *str_n, *str_cached, *str_endpoint;

/* The longest prefix of prompt (tokens, at most all of it) that one of eps that is up holds, in
 * *cached, and that endpoint (borrowed; None if none) in *where; with blocks_out, the blocks
 * every endpoint's table holds (down ones too) added to it. -1 on an error. */
static int find_holder(PyObject *views, Py_ssize_t header, PyObject *prompt, PyObject *endpoints, Py_ssize_t *n_out,
                       Py_ssize_t *cached_out, PyObject **where_out, int64_t *blocks_out) {
    if (!PyDict_Check(views)) {
        PyErr_SetString(PyExc_TypeError, "views must be a dict");
        return -1;
    }
    PyObject *eps = PySequence_Fast(endpoints, "endpoints must be a sequence");
    if (!eps)
        return -1;
    Py_ssize_t cached = 0, n;
    PyObject *where = Py_None;
    int rc = -1;
    if (Py_IS_TYPE(prompt, &ChatPromptType))
        n = ((ChatPromptObject *)prompt)->n;
    else {
        PyObject *n_obj = PyObject_GetAttr(prompt, str_n);
        n = n_obj ? PyLong_AsSsize_t(n_obj) : -1;
        Py_XDECREF(n_obj);
        if (n == -1 && PyErr_Occurred())
            goto done;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(eps); i++) {
        PyObject *ep = PySequence_Fast_GET_ITEM(eps, i);
        PyObject *base = PyObject_GetAttr(ep, str_base);
        if (!base)
            goto done;
        PyObject *view = PyDict_GetItemWithError(views, base);
        Py_DECREF(base);
        if (!view) {
            if (PyErr_Occurred())
                goto done;
            continue;
        }
        Py_buffer buf;
        if (PyObject_GetBuffer(view, &buf, PyBUF_SIMPLE) < 0)
            goto done;
        const int64_t *file = buf.buf;
        Py_ssize_t capacity = buf.len / 8 - header, tokens = 0;
        if (blocks_out && capacity > 0 && header >= 3) /* every endpoint's, down ones too */
            *blocks_out += __atomic_load_n(&file[2], __ATOMIC_RELAXED);
        PyObject *down = PyObject_GetAttr(ep, str_down);
        int is_down = down ? PyObject_IsTrue(down) : -1;
        Py_XDECREF(down);
        if (is_down) {
            PyBuffer_Release(&buf);
            if (is_down < 0)
                goto done;
            continue;
        }
        int64_t bs = capacity > 0 && header >= 2 ? __atomic_load_n(&file[1], __ATOMIC_RELAXED) : 0;
        if (bs > 0 && (capacity & (capacity - 1)) == 0) {
            const int64_t *slots = file + header;
            ChatPromptObject *p = (ChatPromptObject *)prompt;
            if (Py_IS_TYPE(prompt, &ChatPromptType) && p->bs == bs)
                tokens = run_of_guess(slots, (uint64_t)capacity - 1, p->hashes, p->nblocks, p->known) * bs;
            else {
                PyObject *hashes = PyObject_CallMethod(prompt, "hashes", "L", (long long)bs);
                Py_buffer h;
                if (!hashes || PyObject_GetBuffer(hashes, &h, PyBUF_SIMPLE) < 0) {
                    Py_XDECREF(hashes);
                    PyBuffer_Release(&buf);
                    goto done;
                }
                tokens = run_of(slots, (uint64_t)capacity - 1, h.buf, h.len / 8) * bs;
                PyBuffer_Release(&h);
                Py_DECREF(hashes);
            }
        }
        PyBuffer_Release(&buf);
        if (tokens > cached) {
            cached = tokens;
            where = ep;
        }
    }
    *n_out = n;
    *cached_out = cached < n ? cached : n;
    *where_out = where; /* borrowed from endpoints, which the caller holds */
    rc = 0;
done:
    Py_DECREF(eps);
    return rc;
}

static int header_arg(PyObject *arg, Py_ssize_t *header) {
    *header = PyLong_AsSsize_t(arg);
    return *header == -1 && PyErr_Occurred() ? -1 : 0;
}

PyDoc_STRVAR(holder_doc,
             "holder(views, header, prompt, endpoints) -> (int, endpoint | None)\n\n"
             "SharedReader.holder: the longest prefix of prompt (in tokens, at most all of it)\n"
             "that one of endpoints that is up holds, and that endpoint. views maps an endpoint's\n"
             "base to its whole table file as 64-bit integers: header of them (capacity, block\n"
             "size, blocks held, ...), then the slots. views and header first, so that a reader\n"
             "binds them once (functools.partial) and a request calls C directly.");

static PyObject *sp_holder(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t header, n, cached;
    PyObject *where;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "holder(views, header, prompt, endpoints)");
        return NULL;
    }
    if (header_arg(args[1], &header) < 0 || find_holder(args[0], header, args[2], args[3], &n, &cached, &where, NULL) < 0)
        return NULL;
    return Py_BuildValue("nO", cached, where);
}

PyDoc_STRVAR(place_doc,
             "place(views, header, prompt, endpoints, tally) -> None\n\n"
             "SharedReader.place: holder's answer written into prompt (cached, endpoint), and\n"
             "prompt.n and cached added to tally, a writable buffer of two 64-bit integers. One\n"
             "call where the request path otherwise unpacks a tuple and sets and adds four Python\n"
             "attributes, each a cache miss on a request path whose caches are cold.");

/* The choice written into prompt (cached, endpoint) and added to a tally's two sums. */
static int settle(PyObject *prompt, Py_ssize_t n, Py_ssize_t cached, PyObject *where, int64_t *sums) {
    if (Py_IS_TYPE(prompt, &ChatPromptType)) {
        ChatPromptObject *p = (ChatPromptObject *)prompt;
        p->cached = cached;
        Py_SETREF(p->endpoint, Py_NewRef(where));
    } else {
        PyObject *c = PyLong_FromSsize_t(cached);
        int rc = !c || PyObject_SetAttr(prompt, str_cached, c) < 0 || PyObject_SetAttr(prompt, str_endpoint, where) < 0;
        Py_XDECREF(c);
        if (rc)
            return -1;
    }
    sums[0] += n;
    sums[1] += cached;
    return 0;
}

/* place's work: 0, or -1 with an error set. */
static int place_in(PyObject *views, Py_ssize_t header, PyObject *prompt, PyObject *endpoints, PyObject *tally_obj) {
    Py_ssize_t n, cached;
    PyObject *where;
    Py_buffer tally;
    if (PyObject_GetBuffer(tally_obj, &tally, PyBUF_WRITABLE) < 0)
        return -1;
    int rc = -1;
    if (tally.len != 2 * (Py_ssize_t)sizeof(int64_t))
        PyErr_SetString(PyExc_ValueError, "tally must be two 64-bit integers");
    else if (find_holder(views, header, prompt, endpoints, &n, &cached, &where, NULL) == 0)
        rc = settle(prompt, n, cached, where, tally.buf);
    PyBuffer_Release(&tally);
    return rc;
}

static PyObject *sp_place(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t header;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "place(views, header, prompt, endpoints, tally)");
        return NULL;
    }
    if (header_arg(args[1], &header) < 0 || place_in(args[0], header, args[2], args[3], args[4]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* -- Prompts and Chooser: kv_aware's two steps on a worker's request path, whole in C ---------
 *
 * The router asks for a request's prompt (KvRouting.prompt), then for an instance (the policy).
 * Done in Python, each is a frame whose code, constants and the attributes it reads are cache
 * misses on a request path whose caches other processes have evicted: about 4 µs each, where
 * the C each calls takes 5 to 10. So the usual case of each step is one call here, and anything
 * else goes to the Python that defines it. */

static PyObject *str_model, *str_engine_type, *str_messages, *str_role_attr, *str_endpoints, *str_load, *str_downs;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *chats; /* dict: (model, engine type) -> Chats */
    PyObject *rest;  /* (req, chat, target) -> prompt | None: what Chats does not read */
    /* The last target found a Chats, and that Chats: a target's model and engine type are
     * fixed for its life, and requests come to the same few targets. */
    PyObject *last_target, *last_chats;
} PromptsObject;

/* The Chats for target's model and engine type: borrowed, NULL when none (or on an error). */
static PyObject *target_chats(PyObject *chats, PyObject *target) {
    PyObject *model = PyObject_GetAttr(target, str_model);
    PyObject *engine_type = model ? PyObject_GetAttr(target, str_engine_type) : NULL;
    PyObject *key = engine_type ? PyTuple_Pack(2, model, engine_type) : NULL;
    PyObject *found = key ? PyDict_GetItemWithError(chats, key) : NULL;
    Py_XDECREF(key);
    Py_XDECREF(engine_type);
    Py_XDECREF(model);
    return found && Py_IS_TYPE(found, &ChatsType) ? found : NULL;
}

static PyObject *Prompts_vectorcall(PromptsObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 3 || kwnames) {
        PyErr_SetString(PyExc_TypeError, "Prompts(req, chat, target)");
        return NULL;
    }
    PyObject *req = args[0];
    if (args[1] == Py_True && PyDict_Check(req)) {
        PyObject *chats = self->last_chats;
        if (args[2] != self->last_target) {
            if (!(chats = target_chats(self->chats, args[2]))) {
                if (PyErr_Occurred())
                    return NULL;
            } else { /* only a found one: a tokenizer may load later */
                Py_XSETREF(self->last_target, Py_NewRef(args[2]));
                Py_XSETREF(self->last_chats, Py_NewRef(chats));
            }
        }
        if (chats) {
            Py_INCREF(chats);
            PyObject *messages = PyDict_GetItemWithError(req, str_messages);
            PyObject *p = messages || !PyErr_Occurred()
                              ? chats_read((ChatsObject *)chats, messages ? messages : Py_None, ((ChatsObject *)chats)->bs)
                              : NULL;
            Py_DECREF(chats);
            if (!p) { /* a tokenizer error only costs the hint, as in Tokens.read */
                PyErr_Clear();
                Py_RETURN_NONE;
            }
            if (p != Py_None) {
                if (((ChatPromptObject *)p)->n)
                    return p;
                Py_DECREF(p);
                Py_RETURN_NONE;
            }
            Py_DECREF(p);
        }
    }
    return PyObject_Vectorcall(self->rest, args, nargs, NULL);
}

static PyObject *Prompts_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *chats, *rest;
    static char *kwlist[] = {"chats", "rest", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O:Prompts", kwlist, &PyDict_Type, &chats, &rest))
        return NULL;
    if (!PyCallable_Check(rest)) {
        PyErr_SetString(PyExc_TypeError, "rest must be callable");
        return NULL;
    }
    PromptsObject *self = (PromptsObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->vectorcall = (vectorcallfunc)Prompts_vectorcall;
    self->chats = Py_NewRef(chats);
    self->rest = Py_NewRef(rest);
    return (PyObject *)self;
}

static int Prompts_traverse(PromptsObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->chats);
    Py_VISIT(self->rest);
    Py_VISIT(self->last_target);
    Py_VISIT(self->last_chats);
    return 0;
}

static int Prompts_clear(PromptsObject *self) {
    Py_CLEAR(self->chats);
    Py_CLEAR(self->rest);
    Py_CLEAR(self->last_target);
    Py_CLEAR(self->last_chats);
    return 0;
}

static void Prompts_dealloc(PromptsObject *self) {
    PyObject_GC_UnTrack(self);
    Prompts_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject PromptsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "motor_mesh.coordinator.kv._speedups.Prompts",
    .tp_doc = PyDoc_STR("Prompts(chats, rest)(req, chat, target) -> prompt | None\n\n"
                        "KvRouting.prompt: a chat request read by the Chats that chats (a dict) maps\n"
                        "(target.model, target.engine_type) to, at its block_size; any other request,\n"
                        "or a chat that Chats does not read, is rest(req, chat, target)'s. None for\n"
                        "an empty prompt or a chat Chats fails to read."),
    .tp_basicsize = sizeof(PromptsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(PromptsObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = Prompts_new,
    .tp_traverse = (traverseproc)Prompts_traverse,
    .tp_clear = (inquiry)Prompts_clear,
    .tp_dealloc = (destructor)Prompts_dealloc,
};

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *views; /* as place's */
    Py_ssize_t header;
    PyObject *tallies; /* dict: role -> tally */
    PyObject *general; /* the policy (targets, exclude, prompt) for every other case */
    double prefix_weight, load_weight;
    /* The last lone target, its tally and endpoints (fixed for a target's life, as its role). */
    PyObject *last_target, *last_tally, *last_endpoints;
} ChooserObject;

/* The candidates of a call (targets, exclude, prompt) that is the usual case, borrowed: a list
 * or tuple of targets, nothing excluded and a prompt; else NULL (and -1 in *rc on an error). */
static PyObject *plain_call(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int *rc) {
    *rc = 0;
    if (kwnames || nargs != 3 || args[2] == Py_None)
        return NULL;
    PyObject *targets = args[0];
    if (!(PyList_CheckExact(targets) || PyTuple_CheckExact(targets)) || PySequence_Fast_GET_SIZE(targets) == 0)
        return NULL;
    int excluded = PyObject_IsTrue(args[1]);
    if (excluded)
        *rc = excluded < 0 ? -1 : 0;
    return excluded ? NULL : targets;
}

/* A target's tally for its role, a new reference; NULL without an error when tallies has none. */
static PyObject *tally_of(ChooserObject *self, PyObject *target) {
    PyObject *role = PyObject_GetAttr(target, str_role_attr);
    if (!role)
        return NULL;
    PyObject *tally = PyDict_GetItemWithError(self->tallies, role);
    Py_DECREF(role);
    return Py_XNewRef(tally);
}

static PyObject *lone_target(ChooserObject *self, PyObject *chosen, PyObject *prompt, int *rc) {
    if (chosen != self->last_target) {
        PyObject *tally = tally_of(self, chosen);
        if (!tally) {
            *rc = PyErr_Occurred() ? -1 : 0;
            return NULL;
        }
        PyObject *endpoints = PyObject_GetAttr(chosen, str_endpoints);
        if (!endpoints) {
            Py_DECREF(tally);
            *rc = -1;
            return NULL;
        }
        Py_XSETREF(self->last_target, Py_NewRef(chosen));
        Py_XSETREF(self->last_tally, tally);
        Py_XSETREF(self->last_endpoints, endpoints);
    }
    /* Held across the lookup, which may run Python (an endpoint's attributes). */
    PyObject *tally = Py_NewRef(self->last_tally), *endpoints = Py_NewRef(self->last_endpoints);
    Py_INCREF(chosen);
    *rc = place_in(self->views, self->header, prompt, endpoints, tally);
    Py_DECREF(endpoints);
    Py_DECREF(tally);
    if (*rc < 0)
        Py_CLEAR(chosen);
    return chosen;
}

#define MAX_CANDIDATES 64

static uint64_t rng_state; /* xorshift64*, for ties; seeded with the chat keys */

static uint64_t rng_next(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

/* KvAware._cheapest: the candidate of the lowest cost (prefix_weight x the prompt tokens its
 * engines have not cached + load_weight x its load, then the fewest blocks its engines cache),
 * one at random among equals, placed and counted. NULL without an error where the call is
 * general's: a table with an endpoint down (the candidates are then the healthy ones), more
 * than MAX_CANDIDATES, a role without a tally. */
static PyObject *cheapest_of(ChooserObject *self, PyObject *const *items, Py_ssize_t m, PyObject *prompt, int *rc) {
    *rc = 0;
    PyObject *downs = PyObject_GetAttr(items[0], str_downs);
    PyObject *count = downs ? PyObject_GetAttr(downs, str_n) : NULL;
    int any_down = count ? PyObject_IsTrue(count) : -1;
    Py_XDECREF(count);
    Py_XDECREF(downs);
    if (any_down) {
        *rc = any_down < 0 ? -1 : 0;
        return NULL;
    }
    Py_ssize_t tie[MAX_CANDIDATES], cached_of[MAX_CANDIDATES], ties = 0, n = 0;
    PyObject *where_of[MAX_CANDIDATES];
    double best = 0;
    int64_t best_blocks = 0;
    PyObject *chosen = NULL;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *endpoints = PyObject_GetAttr(items[i], str_endpoints);
        PyObject *load_obj = endpoints ? PyObject_GetAttr(items[i], str_load) : NULL;
        double load = load_obj ? PyFloat_AsDouble(load_obj) : -1.0;
        Py_XDECREF(load_obj);
        Py_ssize_t cached;
        PyObject *where;
        int64_t blocks = 0;
        if ((load == -1.0 && PyErr_Occurred()) ||
            find_holder(self->views, self->header, prompt, endpoints, &n, &cached, &where, &blocks) < 0) {
            Py_XDECREF(endpoints);
            goto error;
        }
        Py_INCREF(where); /* it was borrowed from endpoints */
        Py_DECREF(endpoints);
        double cost = self->prefix_weight * (double)(n - cached) + self->load_weight * load;
        if (!ties || cost < best || (cost == best && blocks < best_blocks)) {
            for (Py_ssize_t k = 0; k < ties; k++)
                Py_DECREF(where_of[k]);
            ties = 0;
            best = cost;
            best_blocks = blocks;
        } else if (cost != best || blocks != best_blocks) {
            Py_DECREF(where);
            continue;
        }
        tie[ties] = i;
        cached_of[ties] = cached;
        where_of[ties++] = where;
    }
    Py_ssize_t k = ties == 1 ? 0 : (Py_ssize_t)(rng_next() % (uint64_t)ties);
    PyObject *tally = tally_of(self, items[tie[k]]);
    if (!tally) {
        *rc = PyErr_Occurred() ? -1 : 0;
        goto release;
    }
    Py_buffer sums;
    if (PyObject_GetBuffer(tally, &sums, PyBUF_WRITABLE) == 0) {
        if (sums.len != 2 * (Py_ssize_t)sizeof(int64_t))
            PyErr_SetString(PyExc_ValueError, "tally must be two 64-bit integers");
        else if (settle(prompt, n, cached_of[k], where_of[k], sums.buf) == 0)
            chosen = Py_NewRef(items[tie[k]]);
        PyBuffer_Release(&sums);
    }
    Py_DECREF(tally);
    if (!chosen)
        *rc = -1;
release:
    for (Py_ssize_t j = 0; j < ties; j++)
        Py_DECREF(where_of[j]);
    return chosen;
error:
    *rc = -1;
    goto release;
}

static PyObject *cheapest(ChooserObject *self, PyObject *targets, PyObject *prompt, int *rc) {
    Py_ssize_t m = PySequence_Fast_GET_SIZE(targets);
    *rc = 0;
    if (m > MAX_CANDIDATES)
        return NULL;
    /* Held: the lookups below may run Python (an endpoint's attributes), which could change a
     * list of targets under us. */
    PyObject *items[MAX_CANDIDATES];
    for (Py_ssize_t i = 0; i < m; i++)
        items[i] = Py_NewRef(PySequence_Fast_GET_ITEM(targets, i));
    PyObject *chosen = cheapest_of(self, items, m, prompt, rc);
    for (Py_ssize_t i = 0; i < m; i++)
        Py_DECREF(items[i]);
    return chosen;
}

static PyObject *Chooser_vectorcall(ChooserObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    int rc;
    PyObject *targets = plain_call(args, nargs, kwnames, &rc), *chosen = NULL;
    if (targets)
        chosen = PySequence_Fast_GET_SIZE(targets) == 1
                     ? lone_target(self, PySequence_Fast_GET_ITEM(targets, 0), args[2], &rc)
                     : cheapest(self, targets, args[2], &rc);
    if (chosen || rc < 0)
        return chosen;
    return PyObject_Vectorcall(self->general, args, nargsf, kwnames);
}

static PyObject *Chooser_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *views, *tallies, *general;
    Py_ssize_t header;
    double prefix_weight, load_weight;
    static char *kwlist[] = {"views", "header", "tallies", "general", "prefix_weight", "load_weight", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!nO!Odd:Chooser", kwlist, &PyDict_Type, &views, &header,
                                     &PyDict_Type, &tallies, &general, &prefix_weight, &load_weight))
        return NULL;
    if (!PyCallable_Check(general)) {
        PyErr_SetString(PyExc_TypeError, "general must be callable");
        return NULL;
    }
    ChooserObject *self = (ChooserObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->vectorcall = (vectorcallfunc)Chooser_vectorcall;
    self->views = Py_NewRef(views);
    self->header = header;
    self->tallies = Py_NewRef(tallies);
    self->general = Py_NewRef(general);
    self->prefix_weight = prefix_weight;
    self->load_weight = load_weight;
    return (PyObject *)self;
}

static int Chooser_traverse(ChooserObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->views);
    Py_VISIT(self->tallies);
    Py_VISIT(self->general);
    Py_VISIT(self->last_target);
    Py_VISIT(self->last_tally);
    Py_VISIT(self->last_endpoints);
    return 0;
}

static int Chooser_clear(ChooserObject *self) {
    Py_CLEAR(self->views);
    Py_CLEAR(self->tallies);
    Py_CLEAR(self->general);
    Py_CLEAR(self->last_target);
    Py_CLEAR(self->last_tally);
    Py_CLEAR(self->last_endpoints);
    return 0;
}

static void Chooser_dealloc(ChooserObject *self) {
    PyObject_GC_UnTrack(self);
    Chooser_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ChooserType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "motor_mesh.coordinator.kv._speedups.Chooser",
    .tp_doc = PyDoc_STR("Chooser(views, header, tallies, general, prefix_weight, load_weight)\n"
                        "(targets, exclude, prompt) -> target\n\n"
                        "KvAware.choose for a worker, with nothing excluded and a prompt: a lone target is\n"
                        "place(views, header, prompt, target.endpoints, tally) and that target; among\n"
                        "several (up to 64, none of their table's endpoints down) the cheapest, as\n"
                        "KvAware._cheapest weighs them, placed and counted the same way (the tally of the\n"
                        "chosen target's role in tallies, a dict). Every other call is general's."),
    .tp_basicsize = sizeof(ChooserObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(ChooserObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = Chooser_new,
    .tp_traverse = (traverseproc)Chooser_traverse,
    .tp_clear = (inquiry)Chooser_clear,
    .tp_dealloc = (destructor)Chooser_dealloc,
};

/* -- writing a table (the management process): Table.update --------------------------------- */

/* Where key is, or the empty slot that ends its probe run (the table is never full: see room). */
static uint64_t table_slot(const int64_t *s, uint64_t mask, int64_t key) {
    uint64_t i = (uint64_t)key & mask;
    while (s[i] && s[i] != key)
        i = (i + 1) & mask;
    return i;
}

/* Remove the entry at i, shifting back each later entry of its run that may live at i (its home
 * slot is not cyclically within (i, j]), so that no lookup meets the hole before its entry. */
static void table_delete(int64_t *s, uint64_t mask, uint64_t i) {
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        int64_t v = s[j];
        if (!v)
            break;
        uint64_t home = (uint64_t)v & mask;
        if ((home <= i && i < j) || (i < j && j < home) || (j < home && home <= i)) {
            __atomic_store_n(&s[i], v, __ATOMIC_RELAXED);
            i = j;
        }
    }
    __atomic_store_n(&s[i], 0, __ATOMIC_RELAXED);
}

PyDoc_STRVAR(table_update_doc,
             "table_update(file, header, changes) -> None\n\n"
             "Table.update: file is a table's whole file as 64-bit integers (header of them, the\n"
             "third the count of blocks held, then the slots); changes maps each hash to whether\n"
             "the table must hold it. Adds past 7/8 of the slots are skipped (shared.room).");

static PyObject *sp_table_update(PyObject *mod, PyObject *args) {
    PyObject *file_obj, *changes;
    Py_ssize_t header;
    if (!PyArg_ParseTuple(args, "OnO!", &file_obj, &header, &PyDict_Type, &changes))
        return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(file_obj, &buf, PyBUF_WRITABLE) < 0)
        return NULL;
    int64_t *file = buf.buf;
    Py_ssize_t capacity = buf.len / 8 - header;
    if (buf.len % 8 || header < 3 || capacity <= 0 || (capacity & (capacity - 1))) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "a table file is a header then a power of two of 64-bit slots");
        return NULL;
    }
    int64_t *s = file + header, held = file[2];
    int64_t room = capacity - capacity / 8; /* shared.room: never full, so every probe ends */
    uint64_t mask = (uint64_t)capacity - 1;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(changes, &pos, &key, &value)) {
        long long h = PyLong_AsLongLong(key);
        if (h == -1 && PyErr_Occurred())
            break;
        int hold = PyObject_IsTrue(value);
        if (hold < 0)
            break;
        int64_t k = h ? (int64_t)h : 1;
        uint64_t i = table_slot(s, mask, k);
        if (hold && !s[i] && held < room) {
            __atomic_store_n(&s[i], k, __ATOMIC_RELAXED);
            held++;
        } else if (!hold && s[i]) {
            table_delete(s, mask, i);
            held--;
        }
    }
    __atomic_store_n(&file[2], held, __ATOMIC_RELAXED);
    PyBuffer_Release(&buf);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* -- following the events (the management process): KvIndex's per-block work ---------------
 *
 * An endpoint's blocks are kept in Python containers, which the index's queries and tests read:
 * `ours`, an OrderedDict of engine hash -> our hash, oldest stored first; `refs`, a dict of our
 * hash -> how many engine hashes stand for it; `changes`, a dict of our hash -> whether the
 * endpoint now holds it, for the shared table. These loops are speedups.hold and
 * speedups.release without the interpreter's dispatch per block (a churning engine's batch
 * stores and evicts a hundred). */

static PyObject *str_move_to_end, *str_popitem, *kw_last;

/* One engine hash fewer for `h`: forgotten with the last one. Returns the change of size. */
static int release_one(PyObject *refs, PyObject *changes, PyObject *h, Py_ssize_t *size) {
    PyObject *count = PyDict_GetItemWithError(refs, h);
    if (!count) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, h);
        return -1;
    }
    long c = PyLong_AsLong(count);
    if (c == -1 && PyErr_Occurred())
        return -1;
    if (c > 1) {
        PyObject *less = PyLong_FromLong(c - 1);
        int rc = less ? PyDict_SetItem(refs, h, less) : -1;
        Py_XDECREF(less);
        return rc;
    }
    if (PyDict_DelItem(refs, h) < 0 || PyDict_SetItem(changes, h, Py_False) < 0)
        return -1;
    (*size)--;
    return 0;
}

PyDoc_STRVAR(hold_doc,
             "hold(ours, refs, changes, engine_hashes, hashes, bound) -> (size change, evicted)\n\n"
             "speedups.hold: a stored chain's blocks, engine_hashes[i] standing for hashes[i].");

static PyObject *sp_hold(PyObject *mod, PyObject *args) {
    PyObject *ours, *refs, *changes, *engine_list, *hashes_obj;
    Py_ssize_t bound;
    if (!PyArg_ParseTuple(args, "OO!O!O!On", &ours, &PyDict_Type, &refs, &PyDict_Type, &changes,
                          &PyList_Type, &engine_list, &hashes_obj, &bound))
        return NULL;
    if (!PyDict_Check(ours)) {
        PyErr_SetString(PyExc_TypeError, "ours must be an OrderedDict");
        return NULL;
    }
    Py_buffer hb;
    if (PyObject_GetBuffer(hashes_obj, &hb, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t n = hb.len / 8, size = 0, evicted = 0;
    const int64_t *hs = hb.buf;
    PyObject *result = NULL;
    if (hb.len % 8 || n != PyList_GET_SIZE(engine_list)) {
        PyErr_SetString(PyExc_ValueError, "one hash per engine hash");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *eh = PyList_GET_ITEM(engine_list, i);
        PyObject *h = PyLong_FromLongLong(hs[i]);
        if (!h)
            goto done;
        PyObject *before = PyDict_GetItemWithError(ours, eh);
        int ok = 0;
        if (before) {
            Py_INCREF(before);
            PyObject *moved = PyObject_CallMethodOneArg(ours, str_move_to_end, eh);
            int same = moved ? PyObject_RichCompareBool(before, h, Py_EQ) : -1;
            Py_XDECREF(moved);
            if (same == 1) {
                Py_DECREF(before);
                Py_DECREF(h);
                continue;
            }
            ok = same == 0 && PyObject_SetItem(ours, eh, h) == 0 && release_one(refs, changes, before, &size) == 0;
            Py_DECREF(before);
        } else if (!PyErr_Occurred() && PyObject_SetItem(ours, eh, h) == 0) {
            ok = 1;
            if (PyObject_Length(ours) > bound) {
                PyObject *no[] = {ours, Py_False}; /* ours.popitem(last=False) */
                PyObject *item = PyObject_VectorcallMethod(str_popitem, no, 1, kw_last);
                if (item && !(PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2))
                    PyErr_SetString(PyExc_TypeError, "ours.popitem() must give a pair");
                ok = !PyErr_Occurred() && release_one(refs, changes, PyTuple_GET_ITEM(item, 1), &size) == 0;
                Py_XDECREF(item);
                evicted++;
            }
        }
        if (ok) {
            PyObject *count = PyDict_GetItemWithError(refs, h);
            long c = count ? PyLong_AsLong(count) : 0;
            PyObject *more = PyErr_Occurred() ? NULL : PyLong_FromLong(c + 1);
            ok = more && PyDict_SetItem(refs, h, more) == 0 && (c || PyDict_SetItem(changes, h, Py_True) == 0);
            Py_XDECREF(more);
            size += ok && !c;
        }
        Py_DECREF(h);
        if (!ok)
            goto done;
    }
    result = Py_BuildValue("nn", size, evicted);
done:
    PyBuffer_Release(&hb);
    return result;
}

PyDoc_STRVAR(release_doc,
             "release(ours, refs, changes, engine_hashes) -> size change\n\n"
             "speedups.release: an engine's removed blocks, those it knows of.");

static PyObject *sp_release(PyObject *mod, PyObject *args) {
    PyObject *ours, *refs, *changes, *engine_list;
    if (!PyArg_ParseTuple(args, "OO!O!O!", &ours, &PyDict_Type, &refs, &PyDict_Type, &changes, &PyList_Type,
                          &engine_list))
        return NULL;
    if (!PyDict_Check(ours)) {
        PyErr_SetString(PyExc_TypeError, "ours must be an OrderedDict");
        return NULL;
    }
    Py_ssize_t size = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(engine_list); i++) {
        PyObject *eh = PyList_GET_ITEM(engine_list, i);
        PyObject *h = PyDict_GetItemWithError(ours, eh);
        if (!h) {
            if (PyErr_Occurred())
                return NULL;
            continue;
        }
        Py_INCREF(h);
        int ok = PyObject_DelItem(ours, eh) == 0 && release_one(refs, changes, h, &size) == 0;
        Py_DECREF(h);
        if (!ok)
            return NULL;
    }
    return PyLong_FromSsize_t(size);
}

/* -- the module ------------------------------------------------------------------------------- */

static PyMethodDef module_methods[] = {
    {"chat_ids", sp_chat_ids, METH_VARARGS, chat_ids_doc},
    {"chain", sp_chain, METH_VARARGS, chain_doc},
    {"unpack_ids", sp_unpack_ids, METH_O, unpack_ids_doc},
    {"held", sp_held, METH_VARARGS, held_doc},
    {"holder", (PyCFunction)(void (*)(void))sp_holder, METH_FASTCALL, holder_doc},
    {"place", (PyCFunction)(void (*)(void))sp_place, METH_FASTCALL, place_doc},
    {"table_update", sp_table_update, METH_VARARGS, table_update_doc},
    {"hold", sp_hold, METH_VARARGS, hold_doc},
    {"release", sp_release, METH_VARARGS, release_doc},
    {"_key_fold", (PyCFunction)(void (*)(void))sp_key_fold, METH_FASTCALL, key_fold_doc},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_speedups",
    PyDoc_STR("kv_aware's request path and the KV index's per-block work in C\n"
              "(see services/coordinator/kv/speedups.py)."),
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    crc_init();
    str_role = PyUnicode_InternFromString("role");
    str_content = PyUnicode_InternFromString("content");
    str_colon = PyUnicode_FromString(": ");
    str_empty = PyUnicode_FromString("");
    str_base = PyUnicode_InternFromString("base");
    str_down = PyUnicode_InternFromString("down");
    str_n = PyUnicode_InternFromString("n");
    str_cached = PyUnicode_InternFromString("cached");
    str_endpoint = PyUnicode_InternFromString("endpoint");
    str_model = PyUnicode_InternFromString("model");
    str_engine_type = PyUnicode_InternFromString("engine_type");
    str_messages = PyUnicode_InternFromString("messages");
    str_role_attr = str_role;
    str_endpoints = PyUnicode_InternFromString("endpoints");
    str_load = PyUnicode_InternFromString("load");
    str_downs = PyUnicode_InternFromString("downs");
    str_move_to_end = PyUnicode_InternFromString("move_to_end");
    str_popitem = PyUnicode_InternFromString("popitem");
    kw_last = Py_BuildValue("(s)", "last");
    PyObject *array_mod = PyImport_ImportModule("array");
    if (!str_role || !str_content || !str_colon || !str_empty || !str_base || !str_down || !str_n || !str_cached ||
        !str_endpoint || !str_model || !str_engine_type || !str_messages || !str_endpoints || !str_load || !str_downs || !str_move_to_end || !str_popitem || !kw_last || !array_mod)
        return NULL;
    array_type = PyObject_GetAttrString(array_mod, "array");
    Py_DECREF(array_mod);
    if (!array_type || PyType_Ready(&ChatsType) < 0 || PyType_Ready(&ChatPromptType) < 0 ||
        PyType_Ready(&PromptsType) < 0 || PyType_Ready(&ChooserType) < 0)
        return NULL;
    /* The chat keys' seed, new in each process (see Chats). */
    PyObject *os_mod = PyImport_ImportModule("os");
    PyObject *random = os_mod ? PyObject_CallMethod(os_mod, "urandom", "i", (int)sizeof(seed)) : NULL;
    Py_XDECREF(os_mod);
    if (!random)
        return NULL;
    memcpy(seed, PyBytes_AS_STRING(random), sizeof(seed));
    rng_state = seed[2] ^ seed[3] ? seed[2] ^ seed[3] : M0; /* xorshift's state is never 0 */
    Py_DECREF(random);
#ifdef AES_FOLD
    __builtin_cpu_init();
    aes_keys = __builtin_cpu_supports("aes") && __builtin_cpu_supports("sse4.1");
#endif
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "Chats", (PyObject *)&ChatsType) < 0 ||
        PyModule_AddObjectRef(m, "ChatPrompt", (PyObject *)&ChatPromptType) < 0 ||
        PyModule_AddObjectRef(m, "Prompts", (PyObject *)&PromptsType) < 0 ||
        PyModule_AddObjectRef(m, "Chooser", (PyObject *)&ChooserType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
