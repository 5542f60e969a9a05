"""The prose of docs/benchmarks.md that no run writes: what makes qwen-npu fast, and the
measurements behind the cpu set's thresholds and choices (render_benchmarks.py places them)."""

FAST = """## What makes qwen-npu fast here

- The LM head runs only for the rows that sample; q/k/v and gate/up are one matrix each.
- `kernels="cpu"` on a CPU with native bf16 (AVX512-BF16, AMX): every matrix is reordered
  once at load into oneDNN's blocked layout (`kernels/onednn.py`), backed by huge pages, and
  every product runs on it (fewer than four rows padded to four); attention runs on bf16 pairs,
  prefill tiles (`csrc/attention_bf16.cpp`) and decode tokens (`csrc/attention_decode_bf16.cpp`,
  K and V read straight from the cache and prefetched ahead; with AMX tiles the scores on the
  tiles, `csrc/attention_decode_amx.cpp`, which prefetches only V), and with AMX tiles prefill
  rows run flash-style on the tiles (`csrc/attention_amx.cpp`, each row's K and V packed once into the tiles' layouts). Without native bf16: every bf16 matrix is packed
  once at load into 16-column panels (`kernels/panels.py`: for each k the 16 weights of 16
  outputs, ordered so that one load widens to fp32 exactly in registers), so no product
  transposes weights; decode streams each panel once, every 256-k block of it taken by passes
  of up to 6 rows while it sits in L1 (batch 1: four panels at a time, prefetched ahead,
  `csrc/linear_packed.cpp`); prefill packs x in 6-row groups and widens
  two panels' blocks into fp32 in L1 for a 6 x 16 register tile. Every output is the same sum in
  k order whatever the number of rows.
- Decode attention takes all KV heads of a token in one work item, so each position's K/V
  (adjacent in the cache) stream through memory in order; positions are found through
  offsets worked out once per item from the block table; the threads claim items one at a time,
  the most work first, so rows of different contexts keep both cores busy to the end.
- Plain weights live in one 2 MiB-aligned arena advised for transparent huge pages.
- q/k head norms and RoPE run as one kernel, SiLU-mul as another, on 16 lanes where the CPU has
  AVX-512 (`csrc/elementwise_avx512.cpp`, the bits of the 8-lane kernels); in decode-sized steps
  SiLU-mul is the epilogue of the gate|up product itself (`gate_up_silu`); greedy sampling and
  the logits health check share one read of the logits (`csrc/greedy.cpp`), and in a step
  sampled in the call that runs it, the LM head's own pass makes them as it stores the logits
  (`lm_head`, `csrc/greedy.h`). On panels, every layer's calls for fewer than 96 rows are made
  in one call from Python (`csrc/layer.cpp`), so Python is not re-entered after every product.
- The scheduler does not admit a prompt in the step where another row is computing the
  blocks it starts with: it waits a step and takes them from the prefix cache.
- Device outputs: one int64 per row crosses to the host per step.
"""

ROUTING = """## Kernel routing: the measurements behind the cpu set's thresholds

Measured on a 2-core AVX512-BF16 host without AMX (interleaved A/B), 0.6B shapes:

- `NATIVE_ROWS = 6` (CPUs with native bf16 but no AVX512-BF16 dot products): torch's bf16 product
  (oneDNN: bf16 products, fp32 sums) was 1.3-2.3x faster than `csrc/linear.cpp` from 8 rows up;
  below 6 rows the C++ kernel streamed the weights as fast or faster. torch's float32 product fed
  with weights widened to fp32 on each call lost to the C++ kernel at every shape (1.1-2.3x).
- `BF16_DOT_ROWS = 20` (AVX512-BF16): one layer's products plus the LM head, ms, dot-product kernel /
  C++ widening kernel / torch: 1 row 11.1 / 13.5 / 16.4, 8 rows 18.1 / 31.4 / 21.9, 16 rows 25.9 /
  41.9 / 26.8, 24 rows 33.6 / 53.8 / 33.3, 32 rows 41.2 / 67.1 / 38.6. Whole batch-16 decode steps:
  106-108 ms with the dot-product kernel, 115-119 ms with torch's product (3 interleaved rounds);
  batch 1: 45 ms, 53-54 ms with the widening kernel.
- `kernels="auto"` on that host: decode steps 1.6x (batch 1) and 2.4x (batch 16) faster with the
  cpu set than with the reference set, before the dot-product kernel.

Measured on a 2-core Intel Xeon capped with `QWEN_NPU_CPU_ISA=avx2` (AVX2 FMA peak 265 GFLOP/s),
2026-12-04, 0.6B shapes (q|k|v, o, gate|up, down and the LM head, GFLOP/s, best of four):

- Panels against plain rows transposed in every call (`csrc/linear.cpp`): 1 row 10.4 ms against
  12.5 for the five products; 4 rows 15.0 / 22.3; 16 rows 34.2 / 39.7 (the layer products at
  180-210 GFLOP/s against 152-160); 32 rows 61.0 / 65.8; 512 rows 907 / 923. Whole steps:
  batch 1 45.5 ms against 54-57, batch 16 142.8 against 161-169.
- `WIDEN_ROWS = 96`: below it each 6-row group widens a panel's block in registers, from it the
  block is widened into fp32 once for all rows: five products, ms, in registers / once: 32 rows
  61.0 / 67.4, 48 rows 83.6 / 86.4, 64 rows 118.5 / 121.8, 96 rows 171.1 / 168.7, 128 rows
  241.8 / 239.3. The same bits either way.
- (An earlier order of the few-rows work, since replaced: see the Zen 3 list below.) Several 6-row
  passes over the 4 panels of a work item took 64 values of k in turn (each chunk of weights read
  from memory once, then served from L1 to the other passes) instead of a whole 256-k block of the
  4 panels each: five products, ms, 8 rows 19.0-19.5 against 22.0, 16 rows 31.2-31.5 against
  33-34, 32 rows 57.9 against 61.0 (chunks of 32: 20.0 / 32.7 / 61.0; of 128: 21.2 / 31.8 / 58.3).
- 16 rows on panels, one product at a time (2026-12-07, peak 257 GFLOP/s, interleaved A/B): with the
  weights in L3 (one matrix again and again) 200-215 GFLOP/s (78-83% of the peak); streamed from
  memory as in a step (28 matrices in turn, in huge pages) 163-180 (64-70%); one thread, 107 against
  87 of 128. So the batch-16 gap is the stream of weights, not the register tile. Without the
  prefetch 2 KiB ahead the streamed rate falls to 140; a distance chosen per pass at run time (1 to
  6 KiB, or the next chunk into L2 during the second pass) did 3-9% worse. Chunks of 128 k and the
  rows shared evenly among the passes (16 as 6 5 5 rather than 6 6 4) gained 2-5% on a product alone
  and nothing in whole steps (batch-16 forward 139.3 against 139.4 ms, batch 8 slower, both sets
  interleaved in one process on the same weights). These were measured on the earlier order; the
  order now used (the Zen 3 list below) shares the rows evenly.
- Many rows, plain weights: transposing two 16-row blocks together and keeping each block's sums
  in rows of 16 (y's rows, 16 KiB apart at N = 4096, fall into few cache sets) took one thread
  from 106 to 115 GFLOP/s on the layer shapes at 512 rows, and a 512-token prefill's products
  from 2380-2480 ms to 2170-2210.

Measured on a 2-core AMD EPYC (Zen 3, AVX2 + FMA, no AVX-512; FMA peak 187-204 GFLOP/s on both
cores, 101.6 on one), 2026-12-07, 0.6B shapes. This host is a virtual machine whose L3 and memory
are shared with other tenants: the same product varies by a third from run to run, so every
comparison below interleaves its variants and divides each by the peak measured beside it.

- 16 rows on panels is bound by the multiply-adds here (a batch-16 step needs ~13 GB/s of the
  34 GB/s the cores read), and the register tile is not what loses: alone on a 256-k block in L1
  the 6-row tile runs at 85-100% of one core's peak, widening in registers or not (fp32 weights,
  or bf16 pairs split by a shift and a mask, were no faster). What lost was the order around it.
  A copy of the few-rows loop outside the extension, 28 matrices streamed in turn from huge pages,
  six interleaved rounds: the earlier order (three passes 6 6 4 over the 4 panels of an item, 64 k
  at a time) 52-73% of the peak on one thread and 49-60% on two; one panel at a time, each
  256-k block taken by all passes before the next (the panel one sequential stream, the block in
  L1 for the second and third pass), the rows shared 6 5 5, the prefetch in the first pass only:
  72-84% on one thread, 63-73% on two (gate|up and down shapes). That order is the one used.
- Whole decode steps, both builds of the extension loaded in one process and swapped between
  rounds on the same weights (three rounds, medians): batch 16 at context 128 237 ms with the
  earlier order, 181 ms with the new (ranges 211-238 and 157-211); batch 1 50.4 and 49.0 ms (the
  one-row tile is unchanged). The LM head alone at 16 rows: 50 ms before, 29-31 ms after (separate
  runs).
- Tried and not kept (within the noise): widening the block into an fp32 buffer during the first
  pass so that the others read fp32 from L1; a prefetch distance of 4, 8 or 16 KiB instead of 2,
  or a prefetch in every pass; taking the block of every panel of an item before the next block
  (x's block kept in L1 across the panels); x rows 16 or 8 floats further apart than K (at K a
  multiple of 1024 every row of x falls into the same L1 sets). Many rows (512): one panel's block
  at a time in L1 instead of two (16 KiB instead of the whole 32 KiB L1) gave 85% and 87% of the
  peak, no difference.
- Where a batch-1 step goes beyond reading the weights (the step 1.35-1.67x its read floor in the
  morning's runs, before a layer's calls were made in one call): the products stream the weights at 25-35 GB/s against the 31-36 GB/s of the read
  floor, the LM head at 29 GB/s; a model of the 0.6B depth with tiny matrices (28 layers, hidden
  64) takes 4.3-4.9 ms per batch-1 step, of which about 1 ms is its LM head and 0.4 ms the host,
  so the forward's calls cost about 3 ms a step whatever the matrices; and decode attention at
  the 0.6B shape (16 query heads, 8 KV heads of 128, two threads) takes 9 us per layer at context
  1, 32 us at 64, 60-90 us at 128 and 250-310 us at 512: about 0.5 us per position, 2-4 times what
  its multiply-adds and widenings need, with K and V widened from bf16 for every 8 values and
  shared by only two query heads. Prefetching K and V 16 positions ahead (as the bf16 and AMX
  decode kernels do) did not change it (context 128: 87-91 against 82-89 us; 512: 260-311 against
  249-302, caches flushed, both builds interleaved): prefetching is not what it lacks (below).
- Decode attention measured again, 2026-12-07. The widening is not what bounds it: a version
  that widens K and V in pairs (a 32-bit lane masked to its top half, and shifted up 16 bits: one
  load and two integer operations per 16 values instead of two loads and four) ran no faster
  from the caches (one thread, context 513: 125 against 121 us; 1025: 265 against 291) or from
  memory (batch 16, context 160, the 28 layers' caches flushed: inside the 16-25 ms the unchanged
  kernel spread over between processes), with or without prefetching 16-32 positions ahead; it
  is not kept. A loop that only reads each token's K and V in the kernel's order, rows claimed by
  two threads, reads them at 21-25 GB/s (batch 16: context 160 in 11.9 ms for the 28 layers, 512
  in 44 ms); the kernel at 12-15 GB/s (20 and 80 ms). Its time is about the sum of its time from
  the caches (about 30 GB/s worth) and the reading's, so computing and reading do not overlap.
  Whole batch-16 steps spend 20-21 ms of 128-180 in decode attention at context 128-250, and
  take 244-250 ms at context 512: there the overlap is the largest lever left in decode (up to
  about 35 ms a step).
- Reading in address order alone does not get it: the same rows read a KV head at a time across
  8, 4 or 2 positions (the kernel's order) went at 15-19 GB/s against 22-24 GB/s for each
  position's whole row in turn, with or without prefetching the next positions; but a kernel that
  copies each 8 positions' K (then V) into an fp32 buffer in address order and computes from it
  (the same sums in the same order: the same bits) was slower everywhere: batch 16, context 160,
  28.6-28.9 against 20.8-25.8 ms; 512, 83-97 against 56-77; batch 1 at 1024, 12.9-17.9 against
  10.1-11.2 (the copy adds a pass that nothing overlaps).
- The loops themselves, one thread, compiled alone, with the K/V of 8-16 positions (in L1 and L2,
  nothing waiting on memory): the scores at 41-50 GFLOP/s, the weighted sum at 38-53, against the
  86 of the register-resident loop on one core; with float32 K/V (no widening at all) 31-41, slower
  still. So neither the widening nor memory bounds them; what does is not known yet (this virtual
  machine exposes no hardware counters; candidates: L1 set conflicts between rows 2 KiB apart,
  the latency of the per-score reductions).
- The KV cache in 2 MiB pages (collapsed with `MADV_COLLAPSE`): decode attention 3-10% faster in
  five interleaved runs (batch 16, context 160: 24.5 / 26.0 and 22.2 / 24.7 ms for the 28 layers;
  512: 60.9 / 65.4 and 74.9 / 77.5; batch 4 at 1024: 34.9 / 36.0); whole batch-16 steps at context
  512, two sessions interleaved: 243.7 against 249.7 ms in one run, 188.2 against 184.7 in another
  (medians of six and eight rounds): inside the noise. Not done; collapsing after the fact also
  costs about 2.7 s per GB, so it would be an arena advised before the cache is first touched, as
  the weights' is.
- Batch-1 products with the work items claimed one at a time by the threads instead of split in
  fixed halves (a core slowed by a neighbour would take fewer): the 28 layers' products and the LM
  head at one row took 45.9 against 46.1 ms (medians of nine interleaved rounds, 26.0 GB/s both;
  the read floor measured 27.5-36.4 GB/s on two threads and 20-21 on one in the same minutes), so
  the threads' imbalance is not the gap to the read floor. Not kept. Nor was the products'
  prefetch made non-temporal (so that the weights' stream would not evict the forward's other
  data): batch-1 steps 41-50 ms either way (five interleaved rounds).
- Returning to Python after a product is slow: a norm and two views took 10-13 us warm, 17-25 us
  right after one layer's gate|up product (12.6 MB streamed) and 70-100 us after all 28; making
  the products' prefetch non-temporal cut the last only to 71 us. So the cpu set made a layer's
  calls for fewer than 96 rows in one call from Python (`csrc/layer.cpp`, the same bits; now all
  the layers' in one, below): in one process with it switched on and off between rounds, a
  28-layer model with tiny matrices took 3.5 instead of 4.4 ms a batch-1 step (9 of 10 rounds
  faster) and 7.6 instead of 8.0 ms at batch 16; the 0.6B shape 45.3 / 46.0 and 51.4 / 52.7 ms
  at batch 1 (7 and 8 of 12 rounds faster; the rounds moved by 10%), at batch 16 within the
  noise (160-225 ms).
- A batch-1 step of the 0.6B timed call by call (context 128-250, three rounds of 20 steps, 51-53
  ms a step): q|k|v, o and down 20.3-21.3 ms (25-26 GB/s), gate|up 12.5-13.6 (26-28 GB/s), the
  LM head 10.4-11.3 (28-30 GB/s), attention 2.2-3.9, norms and RoPE 1.4-1.8, write_kv 0.2, and
  2.6-3.1 ms outside the kernel calls (the host 0.3-0.4 of it; the rest the forward's Python and
  torch's views). Calls cost 2-6 us each whatever their size (timed alone: attention at context 1
  6 us, write_kv 5, add_rms_norm 3, rms_norm 2).
- Batch-16 products measured again, in one process with the FMA peak measured beside every round
  (sixteen rows, eight layers' four matrices, 250 MB, in turn): in most rounds 110-125 GFLOP/s,
  55-65% of the two-core peak, in a few 150-170 (75-85%); one thread alone ran at 61-84% of one
  core's peak (median 78%, two threads 65% in the same rounds). The same bytes in one call: 61%
  (59% in eight); eight matrices that fit the L3 (16 MB): 77-82%; the weights in huge pages or
  not: 59% and 58%. So the tile and the calls are not what loses: with both cores streaming
  weights from memory each core's multiply-adds wait on its stream, although together they read
  only about 7 GB/s. Not
  kept, tried in a copy of the loop outside the extension (about 15% slower than the extension;
  the shares are the copy's own): the next block, or the one after, prefetched spread over all
  three passes instead of 2 KiB ahead in the first (0.57-0.63 against 0.56-0.60; no software
  prefetch 0.54); 4, 8 or 16 blocks ahead into L2 (0.54-0.56); both threads taking half of the
  rows of every panel, so that one stream of weights serves both cores (0.42 against 0.52).
  An hour later the gap was gone: the same eight layers at 16 rows ran at 81-85% of the peak
  from memory and 81-84% from the L3, two threads at 80% against one thread's 84% (binding the
  threads to cores, or making them spin, no better); whole batch-16 steps at context 128 took
  122.8-138.4 ms, 68-76% of the limit measured beside each, against 51-53% in the benchmark run
  of 2026-12-07 11:55 (50% and 66% in a run at 18:10; 73% and 75% in the one above, at 22:34). Most likely what held the products back was other tenants' use of the memory the two
  cores share (this host shows no counters to say so).
- Decode attention of one token over n positions held in the caches, one thread, the 0.6B shape
  (16 query heads over 8 KV heads of 128), the parts timed by leaving the others out: the scores
  run at 40-42% of one core's peak, the weighted sum of V at 32-36%, and the softmax takes about a
  tenth of the time (n = 1024: 102-106, 131-135 and 23-24 us). Not kept: the widening of q, the
  maximum and the rounding of the output 8 lanes at a time (the same bits; 1-3% faster from n = 16
  to 512); K and V widened by one interleave with zeros per 8 values, q and the sums in that order
  (slower: the scores' loop then spills registers); V in chunks of 16 or 32 positions instead of 8
  (no faster); the weighted sum on two heads times 48 values, twelve accumulators instead of
  eight (the same bits: 5-10% faster alone, the whole call within the noise).
- Batch-1 steps against the read floor measured before and after each, four rounds at a time:
  33.5-36.7 ms, 1.20-1.34x the floor (three rounds of four within 1.25x) while memory read at
  38-44 GB/s; 44.5-50.0 ms, 1.36-1.50x, half an hour later (29-39 GB/s); in the benchmark run
  of 2026-12-07 11:55, whose read figures spread over 30-45 GB/s, 1.51x and 2.42x (1.54x and
  1.47x in a run at 18:10, at 32-38 GB/s; 1.15x and 1.18x in the one above, at 22:34, at 33-44 GB/s).
- The host's work in a decode step counted as Python bytecodes (`sys.settrace` with opcode
  events, 20 steps of 16 rows at context 128 on a random two-layer model with hidden size 64 and
  the 0.6B's vocabulary), a count that does not move with the other tenants: 37.4 thousand a step
  before the changes of the changelog's "Less host work in a step", 30.7 thousand after. Timed,
  in alternating processes (median host time of 350 steps each): 0.79-1.29 ms before and
  0.69-1.15 ms after on that model (lower in 3 of 4 pairs; the 25th percentiles in all 4), and on
  the 0.6B over 60 steps each 1.41-1.54 ms before and 1.05-1.43 ms after (3 of 3). The most left
  per step, by phase: scheduling on the draft (5.5 thousand: 16 request drafts and a clone of
  the block tables), the plan (5.0), sampling and staging the tokens (3.9), booking (3.7: the
  tables' commit and the ledger's entries) and the slot check (3.4, 120 a token).
- Many rows (512), x packed into the tile's groups straight from bf16 instead of widened to an
  fp32 copy first (the same bits): the packing took 4.6% of perf's samples of a [512, 3072] x
  [3072, 1024] product loop against 2.9% for packing plus 1.3% for the widening before, and the
  layer's four products ran at 0.766 / 0.814 of the peak against 0.772 / 0.804 (medians of two
  runs of 12 interleaved rounds). Not kept.
- Prefill attention of one 512-token row (16 query heads over 8 KV heads of 128, bf16 caches),
  as a share of the multiply-add peak measured beside it (best and median of 12 interleaved
  rounds): one thread 0.65 and 0.49, two threads 0.56 and 0.46; at 128 tokens, two threads 0.41
  and 0.35. perf puts 70% of its samples in the two products on the register tile (S = Q K^T,
  P V); the rest go to the softmax, K's transposes and V's widening. Chunks of 64 positions
  instead of 32, the last chunk multiplied only as far as its positions go, and q and the output
  converted 8 lanes at a time: one thread 0.67 and 0.50, two threads 0.56 and 0.45, at 128
  tokens 0.41 and 0.34 (in an earlier run of 10 rounds on one thread: 0.64 and 0.63 against 0.63
  and 0.60). Kept, with the fix below. Tiles of 60 query rows (ten register tiles of 6) instead
  of 64: no faster.
- A row's last tile of one token went to the one-token (decode) kernel, whose sums run in
  another order: a prompt cut into chunks whose length leaves one token past a multiple of 32
  got other bits than the whole prompt. The `mixed` workload with `mixed_steps=True` cuts one
  prompt into a chunk of 161 tokens. With that tile through the tile loop, all 32 requests of
  `mixed` give the same tokens with `mixed_steps=True` as without, on the random checkpoint
  (before: 31 of 32, one request parting at its 28th token). A
  prompt chunk of exactly one token still goes to the decode kernel: the kernel cannot tell it
  from a decode row. `mixed` without mixed steps cuts one such chunk. So tokens are not
  identical in general, and the default stays prefill-first.
- Every layer's calls in one call from Python (`decoder_layers`) instead of one call per layer:
  the 0.6B shape, both forms in one process and swapped step by step, three runs of 40 steps
  each, medians: batch 1 48.7 / 49.6, 53.2 / 54.2 and 48.9 / 49.4 ms, batch 16 147.0 / 149.0,
  148.4 / 150.6 and 151.1 / 153.2 ms. Before it, a batch-1 step spent 1.1 ms and a batch-16 step
  2.0 ms of the forward outside the C++ calls (the host 0.6 and 1.1 ms besides). Kept.
- Where the time of a batch-1 step goes, the read measured beside it (torch's sum over 1.19 GB
  in huge pages after every third of 60 steps at context 128): steps 49.0 ms median, 37.4 best;
  the read 39.2 ms median, 31.7 best, so 1.25x the read at the medians and 1.18x at the best. The
  28 layers' products at one row streamed at 31.0 GB/s (median of 12 rounds) against 33.2 for
  the sum interleaved with them, the LM head at 32.8: the products are within 10% of the read,
  and the rest of a step is attention, the norms and the calls. The benchmark's figure divides
  the median step by the best read of the sitting, measured before and after the run (30-45 GB/s
  here), so on this host it moves with the other tenants more than with the code.
- Prefill products alone, the 28 layers' four products at 512 rows, distinct weights as in a
  step, five rounds with the FMA peak measured in each: 80-87% of the peak (median 85%), against
  the 74% the benchmark gives the whole prefill. The prefill figure counts the layers' products
  only, so attention (about a tenth of a 512-token step), the norms, RoPE and the LM head's row
  all count as lost: 90% of the peak on that figure needs the products near the peak and the
  rest nearly free.
- Decode rows that share a prefix's blocks (the `seed` workload: sixteen rows on one 496-token
  prefix) taken together, tried and not kept: one work item per KV head over all the rows, each
  8-position chunk of the shared K and V read from memory once and then from L1 by every row,
  with tiles of four query vectors by three positions for the scores and six query vectors by
  16 values of d for the weighted sum (each row's sums in the order it has alone, so the same
  bits), and the rows' own positions prefetched meanwhile. One thread, caches warm: 42.0 to 46.1
  GFLOP/s at context 544 (16 rows sharing 496), 45.1 to 46.2 at 128; two threads, 77.3 to 74.1
  and 75.9 to 69.0; the 28 layers' caches cold at context 544 (16 rows sharing 496), two
  threads, 31.8 to 29.6 ms; `seed`'s decode steps, both builds swapped step by step, 218.7 and
  217.2 ms. Rows that share a prefix already find it in L2 and L3 after the first, so reading it
  once more is not what bounds them: the multiply-adds run at 40-50% of one core's peak either
  way, and the same tiles alone in L1 reach 55-70%.
- 2026-12-08, batch-16 products, the layer's four at 16 rows, builds interleaved round by round (10
  rounds, medians, share of the FMA peak measured in each round): over the 28 layers' distinct
  weights 0.835 and 0.863 (two runs), with one layer's weights, which stay in cache, 0.833 and
  0.827. Streaming the weights from memory costs them nothing measurable: the register tile bounds
  them. Three forms with the same bits were tried and not kept. Prefetching the next block of k
  during the passes that read the block from L1: 0.843 against 0.835. Widening each block once into
  an fp32 copy for the later passes: 0.836 against 0.863 in the quiet rounds (slower). Tiles of
  three rows by two panels (twelve sums, each x value broadcast against 32 columns): 0.424 against
  0.576 in a busier hour (0.73x; the tile needs one register more than AVX2 has).
- 2026-12-08, the host's part of a batch-16 decode step (context 128), the same Python on two
  models: 0.45-0.55 ms on the two-layer model, 0.75-0.85 ms on the 0.6B. The 0.6B's forward streams
  1.2 GB through the caches, so the host's work after it runs on cold code and data. The first torch
  call of a step (a view of a dispatch buffer) took 46-58 us on the 0.6B, against 16-18 us on the
  small model and 2-3 us for each view after it. Prefetching the panels with the non-temporal hint
  instead of T0 left the host at 0.73-0.80 ms against 0.73-0.78 (three pairs of processes); not
  kept. Python's collector ran a generation-0 collection every 5.4 steps (37 in 199 steps) and a
  generation-1 one every 50. With the changes of the changelog's "Fewer operations on the host in a
  decode step", 30.7 thousand bytecodes a step become 29.9 thousand (29.5 thousand in the form timed
  here, which built a missing request draft in place instead of through `StepDraft.of`). Alternating
  processes in a quiet hour, medians of three rounds of 40 steps: 0.76-0.77 ms against 0.80-0.85 on
  the 0.6B, 0.46-0.53 against 0.51-0.57 on the small model. Four pairs an hour later, on a busier
  host (steps 140-190 ms), differed by less than their noise.

Measured on a 2-core Intel Xeon with AMX tiles (and AVX512-BF16), 2026-12-02, 0.6B shapes:

- With AMX, torch's bf16 product runs on the tiles and wins from a few rows: the four products of
  a layer took 1.56 ms at 16 rows against 4.02 ms through the dot-product kernel (0.77 / 2.20 ms at
  1 row, 1.41 / 1.59 ms at 4). Whole decode steps at context 128, three interleaved rounds, best
  of each: batch 8 124-128 ms with torch from 2-8 rows against 175 ms with the old threshold of
  20, batch 16 136-144 ms against 244 ms; batch 4 110-118 ms either way. So on an AMX CPU torch
  takes over from `NATIVE_ROWS` (6) rows.
- Prefill attention of one 512-token row, per layer: the C++ flash loop 19-28 ms, torch's SDPA in
  bf16 4-5 ms (3-D inputs take SDPA's slow path: 26 ms; the kernel passes 4-D ones). Under
  `QWEN_NPU_CPU_ISA=avx2` the C++ loop stays the faster (18.8 ms against 25.6 ms for SDPA in bf16
  and 27.8 ms in fp32), so SDPA is used only with AMX (`SDPA_ROWS = 16` tokens and more).
- Greedy sampling plus the health check of 16 rows of 151936 logits: 2.3 ms for torch's argmax
  alone and two more passes for the check, 0.36 ms for the fused read (`greedy_health`).
- oneDNN's bf16 product with the weights reordered once for it
  (`torch.ops.mkldnn._reorder_linear_weight`) was bit-identical and 27% faster at 16 and 128 rows
  (the same at 512).

Measured on a 2-core AMD EPYC with AVX512-BF16 (no AMX), 2026-12-02, 0.6B shapes, interleaved A/B:

- Weights reordered for oneDNN (`kernels/onednn.py`), the 28 layers' four products in a row, ms,
  plain weights through the routing above / reordered: 1 row 39.8 / 38.2, 2 rows 40.4 / 40.6,
  4 rows 44.2 / 34.3, 16 rows 72.6 / 50.1; the LM head 13.6 / 11.6 (1 row), 16.1 / 10.2 (4),
  27.7 / 19.0 (16). With one or two rows oneDNN takes a slower path than with four (1 row padded
  to 4: 41.5 ms against 47.1), so fewer rows are padded to four. Whole decode steps at context
  128, reordered weights backed by huge pages (`MADV_COLLAPSE`) against plain weights in the
  arena, medians of five interleaved rounds on a busy host: batch 1 57.9 / 58.8 ms, batch 2
  62.8 / 67.6, batch 4 62.8 / 75.3, batch 16 112.8 / 142.7 (without huge pages batch 1 was 5-10%
  slower than on the arena; an earlier, quieter sitting gave batch 16 84 against 108 ms). The products are bit-identical
  to torch's bf16 product on the plain weights; the plain matrices are not kept (a tied LM head
  keeps the embedding and gets a reordered copy).
- Prefill attention tiles: up to 64 query rows per tile instead of 16 (each K/V chunk packed once
  for four times the rows; same bits) took a 512-token row from 16.3 to 13.0 ms per layer; on bf16
  pairs (`csrc/attention_bf16.cpp`) 1.5-2x faster again than the fp32 tile at every shape measured
  (512 tokens: 7-8 ms against 11-15 ms), with errors against float32 attention as large as the
  fp32 tile's (both dominated by the bf16 output). torch's SDPA in bf16 took 22.8 ms there.

Measured on a 2-core Intel Xeon with AMX tiles (and AVX512-BF16), 2026-12-03, 0.6B shapes, on a
host whose runs varied by about 5% from one to the next (the figures are best or median of
interleaved rounds):

- Decode attention on bf16 dot products (`csrc/attention_decode_bf16.cpp`) against the fp32
  decode kernel, 16 rows of 512 positions each in their own blocks, ms per layer: 1.23 against 1.47
  with one layer's K/V (it stays in the 480 MiB L3), 1.83 against 2.57 over 28 layers' (read from
  memory: 18.3 against 13.1 GB/s, of the 30 GB/s a plain sum reads); prefetching 16 positions
  ahead brought 2.1 to 1.9 ms, and 32 or 64 ahead did no better. Backing the caches with huge pages
  changed nothing. Whole batch-16 decode steps at context 512: 140 ms before, 119-126 ms after.
- Products of up to 16 rows on AMX tiles from oneDNN's reordered weights (`csrc/linear_amx.cpp`;
  oneDNN lays a reordered [N, K] matrix out as [N/32][K/2][32][2], the B operand of a tile
  product as it lies), the 28 layers' four products in a row, cold weights: 1 row 34.0 ms against
  44.6 through oneDNN (25.9 against 19.7 GB/s), 4 rows 34.2 / 40.8, 16 rows 35.9 / 42.6, the bits
  identical at every row count. Software prefetch made it slower (the tiles' 16-row loads stream
  well on their own). Whole decode steps at context 128: batch 1 57 ms (61 before), batch 16
  79-80 ms (82-85).
- The bf16 elementwise kernels on 16 AVX-512 lanes against 8 AVX2 lanes, 512 tokens, ms:
  `rms_norm` 0.105 / 0.170, `add_rms_norm` 0.146 / 0.243, `qk_norm_rope` 0.59 / 0.89, `silu_mul`
  0.51 / 0.87 (the norms of a 512-token prefill step: 48 ms before, 32 ms after).
- torch's SDPA for one causal row, 16 query and 8 KV heads of 128, is up to twice as slow at
  lengths that are not a multiple of 16 (333 tokens 2.15 ms, padded to 336 1.04 ms; 428 tokens
  2.48 ms, padded to 432 1.51 ms; 202 tokens 0.92 ms, padded to 208 0.51 ms) and a little faster
  unpadded below about 128 (70 tokens: 0.17 ms against 0.20 ms padded to 80): `SDPA_PAD = 16`,
  `SDPA_PAD_FROM = 128`. Prefilling the 32 prompts of `mixed`: 8.2-8.7 s padded, 8.4-8.8 s not.
- oneDNN's product on the reordered weights, 28 layers' four products in a row, cold weights,
  GFLOP/s: 2068 at 256 rows, 1811 at 512, 2269 at 1024, 2356 at 2048. At exactly 512 rows the
  o projection ([1024, 2048]) falls to half its rate (51 ms against 31 ms for two calls of 256
  rows; at 448 or 640 rows it does not), and the other three lose nothing: most of why a
  512-token prefill step's products take 0.52 ms a token against 0.44 at 1024. Prefilling the 32
  prompts of `mixed`, three interleaved rounds: `chunk_size=512` 8.5-8.7 s, 768 7.4-7.7 s, 1024
  7.2-7.5 s; whole `mixed` runs 29.1 s (512), 27.9 s (768), 28.2 s (1024), 28.9 s (2048). Steps
  of 2048 and 4096 tokens lose much of that to page faults on fresh activations (glibc returns
  them to the system; with `MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_` raised, a
  4096-token step went from 0.88-1.37 to 0.69-0.78 ms a token), none at 512.
- vLLM 0.32 (bfloat16) on the same host, its own steps: prefill 1565 tokens/s for 16 prompts of
  128 and 1358 for 16 of 512 (qwen-npu: 1010-1160), decode at batch 16 and context 128 83 ms
  (qwen-npu: 81-85), batch 1 61.5 ms (qwen-npu: 61-73). vLLM's CPU default is up to 4096 tokens a
  step with decode rows first (`chunk_size=4096` and `mixed_steps=True` here: 29.0 s for `mixed`,
  its first 4096-token step at 1.24 ms a token). The gap on `mixed` is its prefill.
- The `mixed` workload with `mixed_steps=True` against prefill-first (the default): 28.5 against
  29.0 s before products of up to 16 rows moved to the AMX kernel, 26.8 against 27.9 s after (one
  sitting each); on the AMD host above it was the slower (59.5 against 54.1 s). The tokens are
  not the same either way (13 of the first 20 `mixed` requests identical over 12 tokens on the
  random checkpoint; most likely because decode-first packing cuts the prompts into other chunks, and a chunk that
  follows a cached part attends through another call than a whole prompt, with other roundings),
  so the default stays prefill-first.

Measured on a 2-core Intel Xeon with AMX tiles (and AVX512-BF16), 2026-12-04, 0.6B shapes:

- There `vdpbf16ps` issues at 1.9 G/s per core against 7.5 G/s for a 16-lane fp32 FMA (the loops
  of the compute peaks), so a bf16 dot product does half the work of an FMA in the same time.
  Decode attention with the scores on the tiles (`csrc/attention_decode_amx.cpp`) against the
  dot-product kernel, 16 rows, 28 layers' K/V read from memory, ms: 512 positions each 43-46
  against 50-52; 100-700 positions 40.1-40.7 against 43.6-45.6 (20.5 against 18.5 GB/s, where a
  plain two-thread read of the same 32 KiB blocks in random order reaches 25 GB/s and a
  sequential one 30.6). Without prefetching V 16 positions ahead it took 54.7 ms; without
  prefetching K, no longer. The `mixed` workload's decode attention, timed per call: 5.7 to 5.2 s.
- 2026-12-05, same kind of host, that decode attention on the tiles without prefetching K (V
  still prefetched), interleaved with the kernel above, 16 rows, 28 layers in a row, best of 25,
  ms: 512 positions each in their own blocks 42.1-43.6 against 46.2-47.5 (prefetching neither K
  nor V: 41.8-43.7, no better); 16 rows sharing one 512-token prompt 12.9-14.6 against
  16.7-17.1; batch 1 at 512 and batch 16 at 128 positions the same. Whole batch-16 decode steps
  at context 512: 85.8-90.1 against 89.7-91.7 ms. The prefetch instructions stall the core
  (where perf put a quarter of the kernel's samples), while the tiles' strided loads stream K on
  their own.
- Prefill attention on the tiles (`csrc/attention_amx.cpp`) against torch's SDPA and the bf16
  tile, one causal row, 16 query and 8 KV heads of 128, ms: 128 tokens 0.12-0.14 / 0.32 / 0.51,
  304 tokens 0.54-0.62 / 1.09 / 2.5, 512 tokens 1.25-1.41 / 2.14 / 6.5, 1024 tokens 4.2-4.9 / 6.6
  / 25; 64 tokens past a cached 256, 0.21 / 0.46 / 0.93. Prefilling the `mixed` prompts: attention
  1.8 to 0.8 s, a 512-token prefill step 374 to 348 ms.
- A product for prefill rows written on the tiles (32 x 32 outputs in four tiles, the weights in
  oneDNN's layout) reached 1800-2300 GFLOP/s with hot weights where oneDNN reaches 3100, and lost
  more with software prefetch or x repacked in tile order: prefill stays with oneDNN.

Measured on a 2-core Intel Xeon with AMX tiles (and AVX512-BF16), 2026-12-05 and 06, 0.6B shapes,
on a busy host (the AVX2 FMA peak measured between runs moved between 127 and 186 GFLOP/s within
minutes; figures are the best of interleaved rounds):

- Prefill products at 512 rows against the libraries on this machine, all held to AVX2
  (`QWEN_NPU_CPU_ISA=avx2`, `OPENBLAS_CORETYPE=Haswell`, `MKL_ENABLE_INSTRUCTIONS=AVX2`), a
  layer's four products, ms (GFLOP/s), four rounds with the FMA peak measured in each (152-164):
  panels 109.3 (147, 90% of the peak); OpenBLAS 0.3.31's sgemm through numpy 100.3 (161, 98%);
  torch's float32 product 99.2 (162, 99%); BLIS 1.3 from the `blis` wheel 217.8 (74: one core's
  worth; with `BLIS_NUM_THREADS=2` too). By shape, panels / OpenBLAS / torch: q|k|v 29.8 / 26.6 / 26.3, o 14.3 / 13.2
  / 13.4, gate|up 42.4 / 39.4 / 39.7, down 22.9 / 21.2 / 19.9. The libraries multiply float32
  weights, twice the bytes of the bf16 ones: widening a matrix for them in every call took
  0.3-0.8 ms, so torch's product on weights widened per call would be about 5% faster than the
  panels at 512 rows, holding a float32 copy of the matrix for the call (25 MB for gate|up) and
  giving other sums at other row counts; widened and multiplied 256 columns at a time it was
  slower than the panels at every shape (q|k|v 31.1, o 16.1, gate|up 50.2, down 23.2 ms). The
  panels stay. In perf samples of their product the register tile took 86% (about 93% of the
  peak while it runs), a pass copying the sums into y 3.4% and the OpenMP runtime's wait 4.3%:
  the tile now stores y itself and the threads claim blocks one at a time (97.1 against 102.8 ms
  for the four products, best of six rounds; the wait below 1%).
- Batch-16 decode products held to AVX2, the 28 layers' four products at 16 rows: 108.9 ms with
  every layer's weights read from memory (72% of the FMA peak measured in the run), 93.9 ms with
  one layer's weights repeated from the caches (83%); in a whole step 99.6 ms. At 16 rows the
  products are compute bound (the weights read in 32.7 ms at the 27 GB/s measured), so the 15%
  between the two is the stream not overlapping the multiply-adds fully.
- Prefill attention held to AVX2, one 512-token causal row: 10.6 to 9.2-9.6 ms with the running
  maximum on 8 lanes and work items claimed one at a time (67% of the FMA peak, counting the
  causal half); chunks of 64 positions instead of 32 were slower (10.5-16.2 against 9.4-13.3 ms).
- Prefill products on AMX tiles written here against oneDNN on the same reordered weights, 512
  rows, GFLOP/s for q|k|v / o / gate|up / down: a 2 x 2-tile kernel over all of k 2239 / 1767 /
  2195 / 860 against oneDNN's 2358 / 1319 / 2364 / 961; with k in blocks of 256 and rows in
  chunks of 128, 1922 / 1957 / 1861 / 1989 against 2310 / 1279 / 2383 / 2174 (a quiet run). Both
  sit near half the 4938 GFLOP/s of the tiles' peak, bound by reading the weights from L2; only
  the o projection was faster in the kernel here (1.4-1.5x, about 14 ms of a 512-token prefill,
  1% of `mixed`), so prefill stays with oneDNN.
"""
