/* The compiled kernels of exactstep.rows.kernels (whose doc gives the layouts and
 * the Python signatures; the callers, rows.packing, rows.causal and
 * rows.invariants, own the semantics). Plain C over int64 arrays passed by
 * address through ctypes, which releases the GIL for the call; the exceptions,
 * plan_segments and causal_batch at the end, build Python objects and so are
 * functions of the module, called through the Python C API (causal_batch
 * releases the GIL while it fills).
 *
 * Every array is C-contiguous; a 2-D array [F, C] is addressed a[f * C + i]. The
 * layout constants below are checked against rows.kernels at load (layout()). */

#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef int64_t i64;

/* The sweeps over a batch's slots are built for the CPU's widest vectors among
 * these, chosen when the library loads (GCC's function multi-versioning on x86-64
 * Linux); elsewhere for the baseline of the target. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define SWEEP __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SWEEP
#endif

#define IGNORE (-100)
#define MALFORMED (-2) /* the causal fill's answer to row starts outside its plan */
enum { EXAMPLE, OFFSET, LENGTH, PIECE, ARRIVAL, NEXT, SLOT_FIELDS };
enum { COLUMN = 4, PLAN_FIELDS = 5 };
enum { N, CURSOR, NEXT_ARRIVAL, FREE, STATE_FIELDS };
enum { RULE, OVERLAP, PLAIN, SEQ_LEN, FILL_TO };
enum {
    DOCUMENTS, TOKENS, TARGETS, SPLIT_DOCUMENTS, SPLIT_PIECES, SPLIT_LOST, SPLIT_REPEATED,
    TRUNCATED_DOCUMENTS, TRUNCATED_TOKENS, TRUNCATED_LOST, DROPPED_DOCUMENTS,
    DROPPED_TOKENS, DROPPED_LOST, ROWS, REAL, ADMITTED, COUNT_FIELDS
};
enum { SPLIT, TRUNCATE, DROP };
enum { TOKENS_AT, TOKENS_SIZE, INDEX_AT, INDEX_SIZE, OWNED_AT, OWNED_SIZE, MAP_FIELDS };
/* The planner's frame (rows.kernels.PieceBuffer): the addresses and sizes of its
 * arrays, kept up to date by the buffer, and the kernel's answer of whether the
 * planner must act (HELP), so that a call passes one address. */
enum {
    F_SLOTS, F_CAP, F_QUEUES, F_COSTS, F_BITS, F_FREE, F_STATE, F_COST, F_WINDOW, F_WIDTH,
    F_OUT, F_OUT_CAP, F_STARTS, F_COUNTS, F_SETTINGS, F_HELP, PLAN_FRAME
};
/* A fused causal fill's settings (rows.kernels.CausalFill): one split's shard maps,
 * one stream's row settings and its R7 screen (SCREEN 0: none). */
enum {
    X_TABLE, X_STARTS, X_SHARDS, X_CHAT, X_TOKEN_SIZE, X_SEQ_LEN, X_PAD_ID, X_KEEP,
    X_RESET, X_SCREEN, X_VOCAB, X_IGNORE_BOUNDARY, X_NEXT_TOKEN, FILL_FRAME
};
#define AT(type, value) ((type)(intptr_t)(value))

/* The SHA-256 of this file when it was built (setup.py defines it), which
 * rows.kernels compares with the kernels.c beside it: a stale build is refused. */
#ifndef KERNELS_SOURCE_SHA256
#define KERNELS_SOURCE_SHA256 ""
#endif
const char *source_sha256(void) { return KERNELS_SOURCE_SHA256; }

/* The constants above, in the order rows.kernels.LAYOUT lists them. */
void layout(i64 *out) {
    const i64 values[] = {IGNORE, SLOT_FIELDS, ARRIVAL, NEXT, COLUMN, PLAN_FIELDS,
                          STATE_FIELDS, FREE, FILL_TO, COUNT_FIELDS, ADMITTED, DROP,
                          MAP_FIELDS, OWNED_SIZE, MALFORMED, PLAN_FRAME, F_HELP,
                          FILL_FRAME, X_NEXT_TOKEN};
    for (unsigned k = 0; k < sizeof values / sizeof values[0]; k++) out[k] = values[k];
}

/* The planner's buffer: slots [SLOT_FIELDS, cap], queues [2, costs] (head, tail
 * slot of each cost), bits (32 costs per word), free [cap], state [STATE_FIELDS]. */
typedef struct {
    i64 *slots, cap, *queues, costs, *bits, *free, *state;
} Buffer;

/* A new pending piece of cost `charge` at the tail of its cost's queue (the
 * caller provides a free slot). */
static void push(Buffer *b, i64 charge, i64 example, i64 offset, i64 length, i64 piece) {
    i64 *s = b->slots, cap = b->cap;
    i64 slot = b->free[--b->state[FREE]];
    s[EXAMPLE * cap + slot] = example;
    s[OFFSET * cap + slot] = offset;
    s[LENGTH * cap + slot] = length;
    s[PIECE * cap + slot] = piece;
    s[ARRIVAL * cap + slot] = b->state[NEXT_ARRIVAL]++;
    s[NEXT * cap + slot] = -1;
    b->state[N]++;
    i64 tail = b->queues[b->costs + charge];
    if (tail < 0) {
        b->queues[charge] = slot;
        b->bits[charge >> 5] |= (i64)1 << (charge & 31);
    } else {
        s[NEXT * cap + tail] = slot;
    }
    b->queues[b->costs + charge] = slot;
}

/* The highest cost at most `space` with a pending piece, or -1. */
static i64 highest_cost(const i64 *bits, i64 space) {
    i64 w = space >> 5;
    uint64_t word = (uint64_t)bits[w] & (((uint64_t)2 << (space & 31)) - 1);
    while (word == 0) {
        if (--w < 0) return -1;
        word = (uint64_t)bits[w];
    }
    return (w << 5) + 63 - __builtin_clzll(word);
}

/* Remove the head (earliest arrival) of cost `charge`'s queue; its slot, whose
 * fields stay readable until the next push. */
static i64 pop_head(Buffer *b, i64 charge) {
    i64 *s = b->slots, cap = b->cap;
    i64 slot = b->queues[charge];
    i64 following = s[NEXT * cap + slot];
    b->queues[charge] = following;
    if (following < 0) {
        b->queues[b->costs + charge] = -1;
        b->bits[charge >> 5] &= ~((i64)1 << (charge & 31));
    }
    s[ARRIVAL * cap + slot] = -1;
    b->free[b->state[FREE]++] = slot;
    b->state[N]--;
    return slot;
}

/* The buffer of a planner's frame. */
static Buffer framed(const i64 *f) {
    Buffer b = {AT(i64 *, f[F_SLOTS]), f[F_CAP], AT(i64 *, f[F_QUEUES]), f[F_COSTS],
                AT(i64 *, f[F_BITS]), AT(i64 *, f[F_FREE]), AT(i64 *, f[F_STATE])};
    return b;
}

void push_framed(const i64 *f, i64 charge, i64 example, i64 offset, i64 length, i64 piece) {
    Buffer b = framed(f);
    push(&b, charge, example, offset, length, piece);
}

/* Admit the examples of window [3, width] (ids, lengths, targets) from
 * state[CURSOR] on until the buffer holds settings[FILL_TO] pieces or the window
 * ends; an over-long example is cut here when settings[PLAIN] and there are free
 * slots for its pieces, else left for the planner. Returns whether full. */
static int admit(Buffer *b, const i64 *cost, const i64 *window, i64 width, i64 *counts,
                 const i64 *settings) {
    i64 rule = settings[RULE], overlap = settings[OVERLAP], plain = settings[PLAIN];
    i64 seq_len = settings[SEQ_LEN], fill_to = settings[FILL_TO];
    i64 *state = b->state;
    i64 j = state[CURSOR];
    while (state[N] < fill_to && j < width) {
        i64 doc = window[j], length = window[width + j], targets = window[2 * width + j];
        if (length <= seq_len) {
            if (state[FREE] < 1) break;
            push(b, cost[length], doc, 0, length, 0);
            counts[ADMITTED] += 1;
        } else {
            i64 stride = overlap ? seq_len - 1 : seq_len, pieces;
            if (rule == SPLIT)
                pieces = overlap ? (length - 2 + stride) / stride
                                 : (length + seq_len - 1) / seq_len;
            else
                pieces = rule == DROP ? 0 : 1;
            if (!plain || state[FREE] < pieces) break;
            if (rule == DROP) {
                counts[DROPPED_DOCUMENTS] += 1;
                counts[DROPPED_TOKENS] += length;
                counts[DROPPED_LOST] += length - 1;
            } else if (rule == TRUNCATE) {
                counts[TRUNCATED_DOCUMENTS] += 1;
                counts[TRUNCATED_TOKENS] += length - seq_len;
                counts[TRUNCATED_LOST] += length - seq_len;
            } else {
                counts[SPLIT_DOCUMENTS] += 1;
                counts[SPLIT_PIECES] += pieces;
                counts[SPLIT_LOST] += overlap ? 0 : pieces - 1;
                counts[SPLIT_REPEATED] += overlap ? pieces - 1 : 0;
            }
            for (i64 k = 0; k < pieces; k++) {
                i64 start = rule == SPLIT ? k * stride : 0;
                i64 size = length - start < seq_len ? length - start : seq_len;
                push(b, cost[size], doc, start, size, k);
            }
            counts[ADMITTED] += pieces;
        }
        counts[DOCUMENTS] += 1;
        counts[TOKENS] += length;
        counts[TARGETS] += targets;
        j++;
    }
    state[CURSOR] = j;
    return state[N] >= fill_to;
}

int admit_framed(const i64 *f) {
    Buffer b = framed(f);
    return admit(&b, AT(const i64 *, f[F_COST]), AT(const i64 *, f[F_WINDOW]), f[F_WIDTH],
                 AT(i64 *, f[F_COUNTS]), AT(const i64 *, f[F_SETTINGS]));
}

/* Up to rows_wanted rows, each after refilling the buffer (the first row skips it
 * unless refill_first), best fit decreasing. Appends the rows' pieces to out
 * [PLAN_FIELDS, out_cap] from row_starts[0] on; returns the rows made and sets
 * *needs_help when the planner must act (read a window, cut by ownership, end
 * the epoch, make room). */
static i64 plan_rows(Buffer b, const i64 *cost, const i64 *window, i64 width, i64 *out,
                     i64 out_cap, i64 *row_starts, i64 *counts, const i64 *settings,
                     i64 rows_wanted, i64 refill_first, i64 *needs_help) {
    i64 *slots = b.slots, cap = b.cap, *state = b.state, *bits = b.bits;
    i64 seq_len = settings[SEQ_LEN];
    i64 p = row_starts[0], rows = 0;
    *needs_help = 0;
    while (rows < rows_wanted) {
        if (refill_first && !admit(&b, cost, window, width, counts, settings)) {
            *needs_help = 1;
            return rows;
        }
        refill_first = 1;
        i64 space = seq_len, column = 0;
        while (space > 0 && state[N] > 0) {
            i64 charge = highest_cost(bits, space); /* the longest piece that fits */
            if (charge < 0) break;
            i64 slot = pop_head(&b, charge); /* its earliest arrival */
            if (p >= out_cap) { /* the planner sized out; never reached */
                *needs_help = -1;
                return rows;
            }
            out[p] = slots[EXAMPLE * cap + slot];
            out[out_cap + p] = slots[OFFSET * cap + slot];
            out[2 * out_cap + p] = slots[LENGTH * cap + slot];
            out[3 * out_cap + p] = slots[PIECE * cap + slot];
            out[COLUMN * out_cap + p] = column;
            column += slots[LENGTH * cap + slot];
            p++;
            space -= charge;
        }
        rows++;
        row_starts[rows] = p;
        counts[ROWS] += 1;
        counts[REAL] += column;
    }
    return rows;
}

/* plan_rows over a planner's frame: up to `rows` more rows after the plan's first
 * `row` (the plan's arrays sized for them by the planner); F_HELP is set. */
i64 plan_framed(i64 *f, i64 row, i64 rows, i64 refill_first) {
    return plan_rows(framed(f), AT(const i64 *, f[F_COST]), AT(const i64 *, f[F_WINDOW]),
                     f[F_WIDTH], AT(i64 *, f[F_OUT]), f[F_OUT_CAP],
                     AT(i64 *, f[F_STARTS]) + row, AT(i64 *, f[F_COUNTS]),
                     AT(const i64 *, f[F_SETTINGS]), rows, refill_first, &f[F_HELP]);
}

/* Where piece (doc, offset, length) of a plan starts among its shard's tokens (and
 * *shard, the shard's row of maps [S, MAP_FIELDS]), or -1 when the document is not
 * in the maps (documents = starts[shards]), the piece is not inside its document
 * or the document's index entry is not inside its shard. */
static i64 piece_start(const i64 *maps, const i64 *starts, i64 shards, i64 doc, i64 offset,
                       i64 length, const i64 **shard) {
    if (doc < 0 || doc >= starts[shards] || length < 1 || offset < 0) return -1;
    i64 k = 0, hi = shards; /* the shard holding doc: starts[k] <= doc < starts[k + 1] */
    while (hi - k > 1) {
        i64 mid = (k + hi) / 2;
        if (starts[mid] <= doc) k = mid; else hi = mid;
    }
    *shard = maps + k * MAP_FIELDS;
    const i64 *index = (const i64 *)(intptr_t)(*shard)[INDEX_AT];
    i64 row = 3 * (doc - starts[k]);
    if (row + 2 >= (*shard)[INDEX_SIZE] || offset + length > index[row + 1]) return -1;
    i64 a = index[row] + offset;
    return a < 0 || a + length > (*shard)[TOKENS_SIZE] ? -1 : a;
}

/* Ask the caches for the tokens of pieces [first, stop) of the plan (frame f's
 * shards), so that their reads from the memory maps overlap the fill of the row
 * before them. Only a hint: a piece piece_start refuses is skipped (the fill
 * refuses it). */
static void prefetch_pieces(const i64 *f, const i64 *plan, i64 pieces, i64 first, i64 stop) {
    const i64 *maps = AT(const i64 *, f[X_TABLE]), *starts = AT(const i64 *, f[X_STARTS]);
    i64 size = f[X_TOKEN_SIZE];
    for (i64 q = first; q < stop; q++) {
        const i64 *shard;
        i64 length = plan[2 * pieces + q];
        i64 a = piece_start(maps, starts, f[X_SHARDS], plan[q], plan[pieces + q], length,
                            &shard);
        if (a < 0) continue;
        const char *at = (const char *)(intptr_t)shard[TOKENS_AT] + a * size;
        for (i64 b = 0; b < length * size; b += 64) __builtin_prefetch(at + b, 0, 3);
    }
}

/* The causal arrays (rows.causal's semantics) of the rows of plan [PLAN_FIELDS,
 * pieces] that row_starts [rows + 1] list, over shards maps [S, MAP_FIELDS] (tokens
 * of TOKEN, unsigned), written row-major into the [rows * seq_len] outputs. Returns
 * -1, or the first piece outside its document or its shard (the outputs are then
 * not to be used). */
#define FILL_CAUSAL(NAME, TOKEN)                                                         \
SWEEP static i64 NAME(const i64 *maps, const i64 *starts, i64 shards, int chat,                \
                const i64 *plan, i64 pieces, const i64 *row_starts, i64 rows,            \
                i64 seq_len, i64 pad_id, int keep, int reset, i64 *restrict input_ids,   \
                i64 *restrict labels, i64 *restrict position_ids,                       \
                int32_t *restrict segment_ids) {                                        \
    for (i64 r = 0; r < rows; r++) {                                                     \
        i64 base = r * seq_len, first = row_starts[r], stop = row_starts[r + 1];         \
        i64 used = 0;                                                                    \
        for (i64 q = first; q < stop; q++) {                                             \
            i64 doc = plan[q], offset = plan[pieces + q], length = plan[2 * pieces + q];  \
            i64 column = plan[COLUMN * pieces + q];                                      \
            if (column < 0 || column + length > seq_len) return q;                       \
            const i64 *shard;                                                            \
            i64 a = piece_start(maps, starts, shards, doc, offset, length, &shard);       \
            if (a < 0) return q;                                                         \
            const TOKEN *restrict tokens = (const TOKEN *)(intptr_t)shard[TOKENS_AT] + a; \
            const uint8_t *owned = (const uint8_t *)(intptr_t)shard[OWNED_AT];           \
            if (chat && (a + length + 7) / 8 > shard[OWNED_SIZE]) return q;              \
            i64 s = base + column, last = length - 1;                                    \
            i64 *restrict in = input_ids + s, *restrict label = labels + s;              \
            i64 *restrict position = position_ids + s;                                   \
            int32_t *restrict segment = segment_ids + s;                                 \
            int32_t number = (int32_t)(q - first + 1);                                   \
            i64 origin = reset ? 0 : column;                                             \
            /* one output at a time (four store streams at once run at two thirds of    \
             * the speed); the piece's tokens stay in L1 between the loops */             \
            for (i64 t = 0; t < length; t++) in[t] = tokens[t];                         \
            for (i64 t = 0; t < last; t++) label[t] = tokens[t + 1]; /* the next input */ \
            label[last] = IGNORE;                                                        \
            for (i64 t = 0; t < length; t++) position[t] = origin + t;                  \
            for (i64 t = 0; t < length; t++) segment[t] = number;                       \
            if (chat) { /* a label only where its token is an owned target (R5) */      \
                for (i64 t = 0; t < last; t++) {                                         \
                    i64 bit = a + t + 1;                                                 \
                    if (!((owned[bit >> 3] >> (7 - (bit & 7))) & 1)) label[t] = IGNORE;  \
                }                                                                        \
            }                                                                            \
            if (column + length > used) used = column + length;                         \
        }                                                                                \
        for (i64 c = used; c < seq_len; c++) {                                           \
            input_ids[base + c] = pad_id;                                                \
            labels[base + c] = IGNORE;                                                   \
            position_ids[base + c] = 0;                                                  \
            segment_ids[base + c] = 0;                                                   \
        }                                                                                \
        if (keep) { /* a kept boundary: the next segment's first token, owned or not */ \
            for (i64 q = first; q + 1 < stop; q++) {                                     \
                i64 end = base + plan[COLUMN * pieces + q] + plan[2 * pieces + q] - 1;   \
                labels[end] = input_ids[end + 1];                                        \
            }                                                                            \
        }                                                                                \
    }                                                                                    \
    return -1;                                                                           \
}

FILL_CAUSAL(fill_u16, uint16_t)
FILL_CAUSAL(fill_u32, uint32_t)

/* Whether row_starts [rows + 1] do not begin at 0 or do not rise within a plan of
 * `pieces` pieces (a fill would then read outside the plan). */
static int malformed(const i64 *row_starts, i64 rows, i64 pieces) {
    if (rows < 0 || row_starts[0] != 0) return 1;
    for (i64 r = 0; r < rows; r++)
        if (row_starts[r] > row_starts[r + 1] || row_starts[r + 1] > pieces) return 1;
    return 0;
}

/* The causal fill of `rows` rows of the plan, from row_starts on, over frame f's
 * shards and settings, into outputs at their first slot. */
static i64 fill_rows(const i64 *f, const i64 *plan, i64 pieces, const i64 *row_starts,
                     i64 rows, i64 *input_ids, i64 *labels, i64 *position_ids,
                     int32_t *segment_ids) {
    const i64 *maps = AT(const i64 *, f[X_TABLE]), *starts = AT(const i64 *, f[X_STARTS]);
    if (f[X_TOKEN_SIZE] == 2)
        return fill_u16(maps, starts, f[X_SHARDS], (int)f[X_CHAT], plan, pieces, row_starts,
                        rows, f[X_SEQ_LEN], f[X_PAD_ID], (int)f[X_KEEP], (int)f[X_RESET],
                        input_ids, labels, position_ids, segment_ids);
    if (f[X_TOKEN_SIZE] == 4)
        return fill_u32(maps, starts, f[X_SHARDS], (int)f[X_CHAT], plan, pieces, row_starts,
                        rows, f[X_SEQ_LEN], f[X_PAD_ID], (int)f[X_KEEP], (int)f[X_RESET],
                        input_ids, labels, position_ids, segment_ids);
    return row_starts[rows] > row_starts[0] ? row_starts[0] : -1;
}

/* rows.invariants.is_clean over flattened [slots] arrays (segment ids of seg_size
 * bytes): whether no R7 condition can hold (vocab_size < 0: no upper bound). A
 * supervised slot is compared with the next slot along the flattened rows; a
 * row's last column is refused outright when supervised under either rule that
 * compares. */
#define SCREEN(NAME, SEG)                                                                \
SWEEP static int NAME(const i64 *restrict input_ids, const i64 *restrict labels,          \
                      const SEG *restrict segs, i64 slots, i64 seq_len, i64 vocab_size,  \
                      int ignore_boundary, int next_token) {                            \
    uint64_t upper = vocab_size >= 0 ? (uint64_t)vocab_size : (uint64_t)1 << 63;         \
    int label_range = !next_token; /* else implied by the next input's range */          \
    if (slots == 0) return 1;                                                            \
    if (ignore_boundary || next_token)                                                   \
        for (i64 last = seq_len - 1; last < slots; last += seq_len)                      \
            if (labels[last] != IGNORE) return 0;                                        \
    i64 end = slots - 1; /* the last slot has no next slot: checked on its own */        \
    if ((uint64_t)input_ids[end] >= upper) return 0;                                     \
    if (labels[end] != IGNORE && (segs[end] == 0                                         \
                                  || (label_range && (uint64_t)labels[end] >= upper)))   \
        return 0;                                                                        \
    /* one branch-free pass in blocks (vectorised), refused at the first bad block */   \
    for (i64 start = 0; start < end; start += 4096) {                                    \
        i64 stop = start + 4096 < end ? start + 4096 : end;                              \
        uint64_t highest = 0;                                                            \
        int bad = 0;                                                                     \
        for (i64 s = start; s < stop; s++) {                                             \
            uint64_t input = (uint64_t)input_ids[s];                                     \
            highest = input > highest ? input : highest;                                 \
            int wrong = segs[s] == 0;                                                    \
            wrong |= ignore_boundary & (segs[s] != segs[s + 1]);                         \
            wrong |= next_token & (labels[s] != input_ids[s + 1]);                       \
            wrong |= label_range & ((uint64_t)labels[s] >= upper);                       \
            bad |= (labels[s] != IGNORE) & wrong;                                        \
        }                                                                                \
        if (bad || highest >= upper) return 0;                                           \
    }                                                                                    \
    return 1;                                                                            \
}

SCREEN(screen_i32, int32_t)
SCREEN(screen_i64, i64)

i64 screen(const i64 *input_ids, const i64 *labels, const void *segs, i64 seg_size,
           i64 slots, i64 seq_len, i64 vocab_size, i64 ignore_boundary, i64 next_token) {
    if (seq_len < 1) return 0;
    if (seg_size == 4)
        return screen_i32(input_ids, labels, (const int32_t *)segs, slots, seq_len,
                          vocab_size, (int)ignore_boundary, (int)next_token);
    if (seg_size == 8)
        return screen_i64(input_ids, labels, (const i64 *)segs, slots, seq_len,
                          vocab_size, (int)ignore_boundary, (int)next_token);
    return 0;
}

/* How many of labels[:n] are not IGNORE. */
SWEEP i64 count_supervised(const i64 *labels, i64 n) {
    i64 count = 0;
    for (i64 s = 0; s < n; s++) count += labels[s] != IGNORE;
    return count;
}

/* One batch in one call: the causal fill of the plan over frame f's shards and
 * settings (FILL_FRAME), the screen of what it wrote (when f[X_SCREEN]) and the
 * count of its supervised labels -- three functions called in turn (the screen and
 * the count know nothing of how the fill wrote the batch), a row at a time, so that
 * a row is screened and counted while it is still in cache. Screening row by row
 * is the screen of the whole batch: the only comparisons that cross a row's end
 * are those of its last column, which the screen refuses outright when supervised
 * (under either rule that compares). Returns (count << 1) | clean (clean: the
 * screen found nothing; 0 without a screen) once the fill succeeded; else
 * MALFORMED for row starts that do not begin at 0 and rise within the plan, or
 * -3 - q for the first piece q outside its document or shard. */
i64 fill_screened(const i64 *f, const i64 *plan, i64 pieces, const i64 *row_starts,
                  i64 rows, i64 *input_ids, i64 *labels, i64 *position_ids,
                  int32_t *segment_ids) {
    i64 seq_len = f[X_SEQ_LEN], count = 0;
    int clean = f[X_SCREEN] != 0;
    if (malformed(row_starts, rows, pieces)) return MALFORMED;
    if (rows) prefetch_pieces(f, plan, pieces, row_starts[0], row_starts[1]);
    for (i64 r = 0; r < rows; r++) {
        i64 s = r * seq_len;
        if (r + 1 < rows) prefetch_pieces(f, plan, pieces, row_starts[r + 1], row_starts[r + 2]);
        i64 bad = fill_rows(f, plan, pieces, row_starts + r, 1, input_ids + s, labels + s,
                            position_ids + s, segment_ids + s);
        if (bad >= 0) return -3 - bad;
        if (clean)
            clean = screen_i32(input_ids + s, labels + s, segment_ids + s, seq_len, seq_len,
                               f[X_VOCAB], (int)f[X_IGNORE_BOUNDARY], (int)f[X_NEXT_TOKEN]);
        count += count_supervised(labels + s, seq_len);
    }
    return (count << 1) | clean;
}

/* The functions called through the Python C API, because they build objects:
 *
 * plan_segments(pieces, row_starts, kind): each row's segment addresses of a plan
 * (rows.causal.plan_segments): a tuple of rows, each a tuple of `kind`
 * (rows.batch.Segment, a tuple subclass of five fields) of (example, piece,
 * offset, column, length). `pieces` is a C-contiguous int64 [PLAN_FIELDS, P]
 * buffer and `row_starts` an int64 [R + 1] one, non-decreasing within [0, P]; a
 * buffer of another kind is a ValueError.
 *
 * causal_batch(frame, pieces, row_starts, input_ids, labels, position_ids,
 * segment_ids, kind): fill_screened of the plan (rows.kernels.CausalFill, whose
 * frame is the int64 [FILL_FRAME] buffer) into the outputs at those addresses
 * (ints: the caller's tensors of R * seq_len slots), with the GIL released, then
 * the plan's segments as plan_segments builds them: (answer, segments), segments
 * None unless the fill succeeded (answer >= 0). */
static int int64_buffer(PyObject *obj, Py_buffer *view, int ndim) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_SetString(PyExc_ValueError, "the row kernels need C-contiguous int64 arrays");
        return -1;
    }
    const char *f = view->format;
    if (view->ndim != ndim || view->itemsize != 8 || f == NULL
        || !(strcmp(f, "l") == 0 || strcmp(f, "q") == 0 || strcmp(f, "<l") == 0
             || strcmp(f, "<q") == 0 || strcmp(f, "=l") == 0 || strcmp(f, "=q") == 0)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "the row kernels need C-contiguous int64 arrays");
        return -1;
    }
    return 0;
}

static int segment_kind(PyObject *kind) {
    if (PyType_Check(kind) && PyType_IsSubtype((PyTypeObject *)kind, &PyTuple_Type)) return 0;
    PyErr_SetString(PyExc_TypeError, "the segments' kind must be a tuple subclass");
    return -1;
}

/* pieces [PLAN_FIELDS, P] and row_starts [R + 1] as buffers (released by the
 * caller on success), refused as ValueError unless the row starts are
 * non-decreasing within [0, P]. */
static int plan_buffers(PyObject *pieces, PyObject *row_starts, Py_buffer *pv, Py_buffer *sv) {
    if (int64_buffer(pieces, pv, 2) < 0) return -1;
    if (int64_buffer(row_starts, sv, 1) < 0) { PyBuffer_Release(pv); return -1; }
    const i64 *starts = sv->buf;
    i64 rows = sv->shape[0] - 1, count = pv->shape[1];
    int valid = pv->shape[0] == PLAN_FIELDS && rows >= 0 && (rows == 0 || starts[0] >= 0);
    for (i64 r = 0; valid && r < rows; r++)
        valid = starts[r] <= starts[r + 1] && starts[r + 1] <= count;
    if (valid) return 0;
    PyBuffer_Release(pv);
    PyBuffer_Release(sv);
    PyErr_SetString(PyExc_ValueError, "the row kernels need a [PLAN_FIELDS, P] plan and row "
                    "starts non-decreasing within [0, P]");
    return -1;
}

static PyObject *segment_of(PyTypeObject *kind, const i64 *plan, i64 pieces, i64 q) {
    static const int fields[5] = {EXAMPLE, PIECE, OFFSET, COLUMN, LENGTH};
    PyObject *segment = kind->tp_alloc(kind, 5);
    if (segment == NULL) return NULL;
    for (int f = 0; f < 5; f++) {
        PyObject *value = PyLong_FromLongLong(plan[fields[f] * pieces + q]);
        if (value == NULL) { Py_DECREF(segment); return NULL; }
        PyTuple_SET_ITEM(segment, f, value);
    }
    return segment;
}

/* The rows' tuples of segments of a plan whose buffers plan_buffers accepted. */
static PyObject *segments_of(PyTypeObject *kind, const Py_buffer *pv, const Py_buffer *sv) {
    const i64 *plan = pv->buf, *starts = sv->buf;
    i64 pieces = pv->shape[1], rows = sv->shape[0] - 1;
    PyObject *out = PyTuple_New(rows);
    for (i64 r = 0; out != NULL && r < rows; r++) {
        PyObject *row = PyTuple_New(starts[r + 1] - starts[r]);
        if (row == NULL) { Py_CLEAR(out); break; }
        PyTuple_SET_ITEM(out, r, row);
        for (i64 q = starts[r]; q < starts[r + 1]; q++) {
            PyObject *segment = segment_of(kind, plan, pieces, q);
            if (segment == NULL) { Py_CLEAR(out); break; }
            PyTuple_SET_ITEM(row, q - starts[r], segment);
        }
    }
    return out;
}

static PyObject *plan_segments(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "plan_segments(pieces, row_starts, kind)");
        return NULL;
    }
    Py_buffer pv, sv;
    if (segment_kind(args[2]) < 0 || plan_buffers(args[0], args[1], &pv, &sv) < 0) return NULL;
    PyObject *out = segments_of((PyTypeObject *)args[2], &pv, &sv);
    PyBuffer_Release(&pv);
    PyBuffer_Release(&sv);
    return out;
}

static PyObject *causal_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "causal_batch(frame, pieces, row_starts, input_ids, "
                        "labels, position_ids, segment_ids, kind)");
        return NULL;
    }
    void *out[4];
    int missing = 0; /* an output without memory: only for a batch of no slots */
    for (int k = 0; k < 4; k++) {
        out[k] = PyLong_AsVoidPtr(args[3 + k]);
        if (out[k] == NULL && PyErr_Occurred()) return NULL;
        missing |= out[k] == NULL;
    }
    Py_buffer fv, pv, sv;
    if (segment_kind(args[7]) < 0 || int64_buffer(args[0], &fv, 1) < 0) return NULL;
    if (fv.shape[0] != FILL_FRAME) {
        PyBuffer_Release(&fv);
        PyErr_SetString(PyExc_ValueError, "causal_batch needs a frame of FILL_FRAME settings");
        return NULL;
    }
    if (plan_buffers(args[1], args[2], &pv, &sv) < 0) { PyBuffer_Release(&fv); return NULL; }
    if (missing && sv.shape[0] > 1 && ((const i64 *)fv.buf)[X_SEQ_LEN] > 0) {
        PyBuffer_Release(&fv);
        PyBuffer_Release(&pv);
        PyBuffer_Release(&sv);
        PyErr_SetString(PyExc_ValueError, "causal_batch needs the outputs' addresses");
        return NULL;
    }
    i64 answer;
    Py_BEGIN_ALLOW_THREADS
    answer = fill_screened(fv.buf, pv.buf, pv.shape[1], sv.buf, sv.shape[0] - 1, out[0],
                           out[1], out[2], out[3]);
    Py_END_ALLOW_THREADS
    PyObject *segments = answer >= 0 ? segments_of((PyTypeObject *)args[7], &pv, &sv)
                                     : Py_NewRef(Py_None);
    PyBuffer_Release(&fv);
    PyBuffer_Release(&pv);
    PyBuffer_Release(&sv);
    if (segments == NULL) return NULL;
    return Py_BuildValue("(LN)", (long long)answer, segments);
}

static PyMethodDef methods[] = {
    {"plan_segments", (PyCFunction)(void (*)(void))plan_segments, METH_FASTCALL,
     "Each row's segment addresses of a plan (see kernels.c)."},
    {"causal_batch", (PyCFunction)(void (*)(void))causal_batch, METH_FASTCALL,
     "A plan's causal batch filled, screened and counted, and its segments (see kernels.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_kernels",
    .m_doc = "exactstep's compiled row kernels (see rows.kernels)",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
