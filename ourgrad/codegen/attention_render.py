"""The CUDA C++ of the fused attention forward: `render_attention` writes the kernel of one AttentionPlan
(codegen/attention.py: the kernel's operands and output, the plan and the rule that picks it) for NVRTC, sm_80+
(renderer/cuda.py calls it; test/attention_forward_host.py compiles the same text for the CPU). The mma.sync kernel
is written here whole: Q's fragments in registers, the key/value tiles staged by cp.async, S = Q K^T, the masks, the
online softmax, O += P V and the store. With `mma="wgmma"` the copies, the products and the loops are
codegen/attention_wgmma.py's, which takes the masks and the softmax written here as lines. The device functions the
kernel calls (mma, ldmatrix, cp.async, exp2) are codegen/attention_helpers.py's `kernel_helpers`.
"""
from __future__ import annotations

import math

from ourgrad.codegen import attention_wgmma
from ourgrad.codegen.attention import COPY_BYTES, WARP_ROWS, AttentionPlan, Operand
from ourgrad.codegen.attention_helpers import LN_2, LOG2_E, MMA_SHAPES, kernel_helpers

# the C type of each operand dtype's elements (16-bit values as their bits)
STORAGE_TYPE = {"float32": "float", "float16": "unsigned short", "bfloat16": "unsigned short"}


def _element_offset(operand: Operand, batch: str, head: str) -> str:
  return f"{operand.offset} + (long long)({batch}) * {operand.strides[0]} + (long long)({head}) * {operand.strides[1]}"


def _signature(plan: AttentionPlan, name: str, arguments: dict[str, int]) -> list[str]:
  """The kernel's parameters, one per distinct buffer in argument order (q, k and v may be one buffer)."""
  storage = STORAGE_TYPE[plan.dtype]
  count = max(arguments.values()) + 1
  parameters = ", ".join(f"{storage}* __restrict__ out" if position == arguments["out"] else
                         f"const {storage}* __restrict__ buffer{position}" for position in range(count))
  bounds = f"{plan.threads}, {plan.min_ctas}" if plan.min_ctas > 1 else f"{plan.threads}"
  return [f'extern "C" __global__ void __launch_bounds__({bounds}) {name}({parameters}) {{',
          *(f"  const {storage}* {role}_buffer = buffer{arguments[role]};" for role in ("q", "k", "v"))]


def _q_fragment_lines(plan: AttentionPlan) -> list[str]:
  """Q's A fragments of this warp's rows (warp_tiles m tiles of 16), for every k step of S = Q K^T, loaded once into
  registers (rows past L read as 0)."""
  k_step, _, _ = MMA_SHAPES[plan.dtype]
  steps = plan.head_dim // k_step
  # every loop unrolled: the fragments are indexed by constants, so they stay in registers
  lines = [f"  unsigned q_fragments[{plan.warp_tiles}][{steps}][4];",
           "#pragma unroll",
           f"  for (int mt = 0; mt < {plan.warp_tiles}; mt++) {{",
           "#pragma unroll",
           "  for (int half = 0; half < 2; half++) {",
           f"    int row = first_row + mt * {WARP_ROWS} + half * 8;",
           f"    const {STORAGE_TYPE[plan.dtype]}* q_row = q_base + (long long)(row < {plan.length} ? row : 0) * "
           f"{plan.q.strides[2]};",
           f"    bool inside = row < {plan.length};",
           "#pragma unroll",
           f"    for (int step = 0; step < {steps}; step++) {{"]
  stride = plan.q.strides[3]
  if plan.dtype == "float32":
    # a0 (g, q), a1 (g+8, q), a2 (g, q+4), a3 (g+8, q+4)
    lines += ["#pragma unroll",
              "      for (int part = 0; part < 2; part++) {",
              "        int column = step * 8 + part * 4 + quad;",
              f"        q_fragments[mt][step][part * 2 + half] = tf32(inside ? q_row[column * {stride}] : 0.0f);",
              "      }"]
  else:
    # a0a1 (g, 2q..), a2a3 (g+8, 2q..), a4a5 (g, 2q+8..), a6a7 (g+8, 2q+8..): one 32-bit load per pair where the
    # rows are contiguous and 4-byte aligned
    pair = (["        q_fragments[mt][step][part * 2 + half] = inside ? *(const unsigned*)(q_row + column) : 0u;"]
            if plan.q.vector_aligned(2) else
            [f"        unsigned short low = inside ? q_row[column * {stride}] : 0;",
             f"        unsigned short high = inside ? q_row[(column + 1) * {stride}] : 0;",
             "        q_fragments[mt][step][part * 2 + half] = pack_bits(low, high);"])
    lines += ["#pragma unroll",
              "      for (int part = 0; part < 2; part++) {",
              "        int column = step * 16 + part * 8 + quad * 2;",
              *pair,
              "      }"]
  return lines + ["    }", "  }", "  }"]


def _copy_tile_lines(plan: AttentionPlan) -> list[str]:
  """`copy_tile(tile, stage)`: the key and value rows of one tile into shared memory (rows past S as zeros)."""
  storage = STORAGE_TYPE[plan.dtype]
  lines = ["  auto copy_tile = [&](int tile, int stage) {",
           f"    {storage}* k_stage = k_tiles + stage * {plan.tile_elements};",
           f"    {storage}* v_stage = v_tiles + stage * {plan.tile_elements};"]
  if plan.vector_copies:
    vector = COPY_BYTES // plan.itemsize
    pieces = plan.head_dim // vector
    lines += [f"    for (int piece = threadIdx.x; piece < {plan.block_n * pieces}; piece += {plan.threads}) {{",
              f"      int row = piece / {pieces}, column = (piece % {pieces}) * {vector};",
              f"      int key = tile * {plan.block_n} + row;",
              f"      bool inside = key < {plan.source};",
              "      long long clamped = inside ? key : 0;",
              f"      copy16(k_stage + row * {plan.row_pitch} + column, k_base + clamped * {plan.k.strides[2]} + "
              "column, inside);",
              f"      copy16(v_stage + row * {plan.row_pitch} + column, v_base + clamped * {plan.v.strides[2]} + "
              "column, inside);",
              "    }",
              "    copy_commit();"]
  else:
    lines += [f"    for (int element = threadIdx.x; element < {plan.block_n * plan.head_dim}; "
              f"element += {plan.threads}) {{",
              f"      int row = element / {plan.head_dim}, column = element % {plan.head_dim};",
              f"      int key = tile * {plan.block_n} + row;",
              f"      bool inside = key < {plan.source};",
              f"      k_stage[row * {plan.row_pitch} + column] = inside ? k_base[(long long)key * {plan.k.strides[2]} "
              f"+ (long long)column * {plan.k.strides[3]}] : ({storage})0;",
              f"      v_stage[row * {plan.row_pitch} + column] = inside ? v_base[(long long)key * {plan.v.strides[2]} "
              f"+ (long long)column * {plan.v.strides[3]}] : ({storage})0;",
              "    }"]
  return lines + ["  };"]


def _each_tile(statement: str, plan: AttentionPlan, indent: str) -> list[str]:
  """`statement` once per m tile of this warp (`mt`), unrolled."""
  return ["#pragma unroll", f"{indent}for (int mt = 0; mt < {plan.warp_tiles}; mt++) {statement}"]


def _scores_lines(plan: AttentionPlan) -> list[str]:
  """S = Q K^T for this warp's rows (warp_tiles m tiles of 16) and the tile's keys (n tiles of 8), masked. With a
  positive scale S stays unscaled: the softmax folds scale * log2(e) into its exp2's fma (and the max commutes)."""
  n_tiles = plan.block_n // 8
  lines = [f"    float scores[{plan.warp_tiles}][{n_tiles}][4];",
           "#pragma unroll",
           f"    for (int mt = 0; mt < {plan.warp_tiles}; mt++)",
           "#pragma unroll",
           f"    for (int n = 0; n < {n_tiles}; n++) "
           "scores[mt][n][0] = scores[mt][n][1] = scores[mt][n][2] = scores[mt][n][3] = 0.0f;"]
  lines += _scores_ldmatrix_lines(plan) if plan.ldmatrix else _scores_load_lines(plan)
  return lines + _mask_lines(plan)


def _mask_lines(plan: AttentionPlan) -> list[str]:
  """S of keys past S (and, causal, past the row) set to -inf, in the tiles that have any: the last one and, causal,
  those crossing the diagonal; S scaled by scale * log2(e) here where the scale is not folded into the softmax."""
  n_tiles = plan.block_n // 8
  crossing = f" || tile * {plan.block_n} + {plan.block_n - 1} > block_first_row" if plan.causal else ""
  each = ["#pragma unroll",
          f"    for (int mt = 0; mt < {plan.warp_tiles}; mt++)",
          "#pragma unroll",
          f"    for (int n = 0; n < {n_tiles}; n++)",
          "#pragma unroll",
          "      for (int i = 0; i < 4; i++) {"]
  mask = [f"        int key = tile * {plan.block_n} + n * 8 + quad * 2 + (i & 1);",
          f"        int row = first_row + mt * {WARP_ROWS} + (i >> 1) * 8;",
          f"        if (key >= {plan.source}{' || key > row' if plan.causal else ''}) scores[mt][n][i] = NEG_INF;"]
  # one branch around the whole tile's masks (a test inside the unrolled loop left ptxas a branch every 8 keys, taken
  # on every tile)
  return [f"    bool masked = (tile + 1) * {plan.block_n} > {plan.source}{crossing};",
          *([] if plan.folded_scale else [*each, "        scores[mt][n][i] *= scale_log2;", "      }"]),
          "    if (masked) {", *each, *mask, "      }", "    }"]


def _scores_load_lines(plan: AttentionPlan) -> list[str]:
  """S += Q K^T, K's B fragments read from shared memory element by element (TF32) or in 32-bit pairs (16-bit), each
  used by every m tile of the warp."""
  k_step, _, _ = MMA_SHAPES[plan.dtype]
  lines = ["#pragma unroll",
           f"    for (int n = 0; n < {plan.block_n // 8}; n++) {{",
           f"      const {STORAGE_TYPE[plan.dtype]}* key_row = k_stage + (n * 8 + group) * {plan.row_pitch};",
           "#pragma unroll",
           f"      for (int step = 0; step < {plan.head_dim // k_step}; step++) {{"]
  if plan.dtype == "float32":   # b0 (k q, n g), b1 (k q+4, n g): K[n][k] is B[k][n]
    lines += ["        unsigned b0 = tf32(key_row[step * 8 + quad]), b1 = tf32(key_row[step * 8 + quad + 4]);"]
  else:   # b0b1 (k 2q.., n g), b2b3 (k 2q+8.., n g): neighbouring halves of one key row
    lines += ["        const unsigned* pair = (const unsigned*)(key_row + step * 16 + quad * 2);",
              "        unsigned b0 = pair[0], b1 = pair[4];"]
  lines += _each_tile("mma(scores[mt][n], q_fragments[mt][step], b0, b1);", plan, "        ")
  return lines + ["      }", "    }"]


def _scores_ldmatrix_lines(plan: AttentionPlan) -> list[str]:
  """S += Q K^T (16-bit), one ldmatrix.x4 per two n tiles and k step: matrices (keys of tile n, k 0-7 and 8-15 of
  the step), then tile n + 1's; K's rows as stored are B's columns, so no transpose. TF32: an 8x8 matrix of 16-bit
  elements is 8 rows of 4 floats, and lane l gets the float at row l / 4, column l % 4: B's (k q, n g) element; one
  ldmatrix.x4 per n tile and two k steps (columns 0-3, 4-7 of each), rounded to TF32 after. Each fragment serves
  every m tile of the warp."""
  if plan.dtype == "float32":
    return ["#pragma unroll",
            f"    for (int n = 0; n < {plan.block_n // 8}; n++) {{",
            # lane l: row l % 8 of matrix l / 8 (4 floats from column 4 (l / 8) of the step pair)
            f"      const float* rows = k_stage + (n * 8 + (lane & 7)) * {plan.row_pitch} + (lane >> 3) * 4;",
            "#pragma unroll",
            f"      for (int step = 0; step < {plan.head_dim // 8}; step += 2) {{",
            "        unsigned b[4];",
            "        load_matrices(b, rows + step * 8);",
            "#pragma unroll",
            "        for (int i = 0; i < 4; i++) b[i] = tf32(__uint_as_float(b[i]));",
            *_each_tile("{ mma(scores[mt][n], q_fragments[mt][step], b[0], b[1]); "
                        "mma(scores[mt][n], q_fragments[mt][step + 1], b[2], b[3]); }", plan, "        "),
            "      }",
            "    }"]
  return ["#pragma unroll",
          f"    for (int n = 0; n < {plan.block_n // 8}; n += 2) {{",
          # lane l: row l % 8 of matrix l / 8 (tile n + (l / 16), k half (l / 8) % 2)
          f"      const unsigned short* rows = k_stage + ((n + (lane >> 4)) * 8 + (lane & 7)) * {plan.row_pitch} + "
          "((lane >> 3) & 1) * 8;",
          "#pragma unroll",
          f"      for (int step = 0; step < {plan.head_dim // 16}; step++) {{",
          "        unsigned b[4];",
          "        load_matrices(b, rows + step * 16);",
          *_each_tile("{ mma(scores[mt][n], q_fragments[mt][step], b[0], b[1]); "
                      "mma(scores[mt][n + 1], q_fragments[mt][step], b[2], b[3]); }", plan, "        "),
          "      }",
          "    }"]


def _softmax_lines(plan: AttentionPlan, deferred: bool = False) -> list[str]:
  """The online softmax per row (a quad of lanes shares a row): the running max (in log2 units: S scaled by
  scale * log2(e)), the old sums and outputs rescaled, P = exp2(S scale log2(e) - max) in place of the scores, the
  scale folded into one fma per element where it is positive. `deferred`: the outputs' factor is kept in
  row_rescale for _rescale_lines (a P V still in flight adds to them). With plan.rescale_slack the reference a row's
  P is taken against moves only where the tile's max passes it by more than the slack (_lazy_softmax_lines)."""
  if plan.rescale_slack: return _lazy_softmax_lines(plan, deferred)
  scaled_max = "tile_max * scale_log2" if plan.folded_scale else "tile_max"
  return ["#pragma unroll",
          f"    for (int mt = 0; mt < {plan.warp_tiles}; mt++)",
          "#pragma unroll",
          "    for (int half = 0; half < 2; half++) {",
          *_tile_max_lines(plan),
          f"      float new_max = fmaxf(row_max[mt][half], {scaled_max});",
          # a row whose keys so far are all masked keeps max -inf: subtract 0 instead (its P is 0 either way)
          "      float reference = new_max == NEG_INF ? 0.0f : new_max;",
          "      float rescale = fast_exp2(row_max[mt][half] - reference);",
          "      row_max[mt][half] = new_max;",
          *_power_sum_lines(plan),
          # each lane keeps its own part of the sum: the quad adds them once, at the end
          "      row_sum[mt][half] = row_sum[mt][half] * rescale + partial;",
          *_kept_rescale_lines(plan, deferred),
          "    }"]


def _lazy_softmax_lines(plan: AttentionPlan, deferred: bool) -> list[str]:
  """The online softmax with a lazy reference (FlashAttention-4's conditional rescale): a row's P is exp2 of its
  scaled scores less row_max, and row_max moves to the running max only where this tile's max passes it by more
  than plan.rescale_slack (log2 units: P stays under 2^slack, as exactly rounded to 16 bits as under 1). The warp
  votes: where no row of it passes, the sums and outputs keep their scale and the tile skips the rescale's exp2s and
  the D / 2 multiplies of the outputs a row half (`rescaled` tells _rescale_lines). Slack 0 would be the eager
  softmax's arithmetic exactly; the lse (row_max + log2 sum) holds with any reference."""
  scaled_max = "tile_max * scale_log2" if plan.folded_scale else "tile_max"
  each = ["#pragma unroll", f"    for (int mt = 0; mt < {plan.warp_tiles}; mt++)",
          "#pragma unroll", "    for (int half = 0; half < 2; half++) {"]
  return [f"    float tile_maxima[{plan.warp_tiles}][2];",
          "    bool passes = false;",
          *each,
          *_tile_max_lines(plan),
          f"      tile_maxima[mt][half] = {scaled_max};",
          f"      passes |= tile_maxima[mt][half] > row_max[mt][half] + {float(plan.rescale_slack)!r}f;",
          "    }",
          "    bool rescaled = __any_sync(0xffffffffu, passes);",
          "    if (rescaled) {",
          *each,
          "      float new_max = fmaxf(row_max[mt][half], tile_maxima[mt][half]);",
          "      float rescale = fast_exp2(row_max[mt][half] - (new_max == NEG_INF ? 0.0f : new_max));",
          "      row_max[mt][half] = new_max;",
          "      row_sum[mt][half] *= rescale;",
          *_kept_rescale_lines(plan, deferred),
          "    }",
          "    }",
          *each,
          # a row whose keys so far are all masked keeps max -inf: subtract 0 instead (its P is 0 either way)
          "      float reference = row_max[mt][half] == NEG_INF ? 0.0f : row_max[mt][half];",
          *_power_sum_lines(plan),
          "      row_sum[mt][half] += partial;",
          "    }"]


def _tile_max_lines(plan: AttentionPlan) -> list[str]:
  """tile_max: the max of the tile's scores in row half `half` of m tile `mt`, over the quad that shares the row
  (tree_reduce: a tree of depth log2(block_n / 8) + 1 over the lane's pairs, else a chain)."""
  pairs = [f"fmaxf(scores[mt][{n}][half * 2], scores[mt][{n}][half * 2 + 1])" for n in range(plan.block_n // 8)]
  own = (_tree_lines("tile_max", pairs, "fmaxf({}, {})") if plan.tree_reduce else
         ["      float tile_max = NEG_INF;",
          "#pragma unroll",
          f"      for (int n = 0; n < {plan.block_n // 8}; n++) "
          "tile_max = fmaxf(tile_max, fmaxf(scores[mt][n][half * 2], scores[mt][n][half * 2 + 1]));"])
  return [*own,
          "      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));",
          "      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));"]


def _power_sum_lines(plan: AttentionPlan) -> list[str]:
  """P = exp2(S scale log2(e) - reference) in place of the row half's scores, and `partial`: this lane's part of
  their sum."""
  def power(element: str) -> str:
    argument = f"fmaf({element}, scale_log2, -reference)" if plan.folded_scale else f"{element} - reference"
    # (n is a constant in the unrolled loop: each element is one or the other)
    if plan.exp_poly: return (f"{element} = n % {plan.exp_poly} == {plan.exp_poly - 1} ? poly_exp2({argument}) : "
                              f"fast_exp2({argument});")
    return f"{element} = fast_exp2({argument});"
  if plan.tree_reduce:
    pairs = [f"scores[mt][{n}][half * 2] + scores[mt][{n}][half * 2 + 1]" for n in range(plan.block_n // 8)]
    return ["#pragma unroll",
            f"      for (int n = 0; n < {plan.block_n // 8}; n++) {{",
            "        " + power("scores[mt][n][half * 2]"),
            "        " + power("scores[mt][n][half * 2 + 1]"),
            "      }",
            *_tree_lines("partial", pairs, "{} + {}")]
  return ["      float partial = 0.0f;",
          "#pragma unroll",
          f"      for (int n = 0; n < {plan.block_n // 8}; n++) {{",
          "        " + power("scores[mt][n][half * 2]"),
          "        " + power("scores[mt][n][half * 2 + 1]"),
          "        partial += scores[mt][n][half * 2] + scores[mt][n][half * 2 + 1];",
          "      }"]


def _tree_lines(target: str, leaves: list[str], combine: str) -> list[str]:
  """`float target` = the leaves combined pairwise in a tree (`combine` formats two operands): log2 of their count
  levels of independent operations, where a chain would be as many dependent ones as leaves (each waits out the
  last one's latency)."""
  names = [f"{target}_{index}" for index in range(len(leaves))]
  lines = [f"      float {name} = {leaf};" for name, leaf in zip(names, leaves)]
  while len(names) > 1:
    lines += [f"      {names[index]} = {combine.format(names[index], names[index + 1])};"
              for index in range(0, len(names) - 1, 2)]
    names = names[::2]
  return lines + [f"      float {target} = {names[0]};"]


def _kept_rescale_lines(plan: AttentionPlan, deferred: bool) -> list[str]:
  """The outputs of the row half times `rescale`, or (deferred) the factor kept in row_rescale."""
  if deferred: return ["      row_rescale[mt][half] = rescale;"]
  return ["#pragma unroll",
          f"      for (int d = 0; d < {plan.head_dim // 8}; d++) {{",
          "        outputs[mt][d][half * 2] *= rescale;",
          "        outputs[mt][d][half * 2 + 1] *= rescale;",
          "      }"]


def _rescale_lines(plan: AttentionPlan) -> list[str]:
  """The outputs times the factor a deferred softmax kept (row_rescale) of their row (rescale_slack: where the tile's
  softmax rescaled)."""
  return [*(["    if (rescaled)"] if plan.rescale_slack else []),
          "#pragma unroll",
          f"    for (int mt = 0; mt < {plan.warp_tiles}; mt++)",
          "#pragma unroll",
          f"    for (int d = 0; d < {plan.head_dim // 8}; d++)",
          "#pragma unroll",
          "      for (int i = 0; i < 4; i++) outputs[mt][d][i] *= row_rescale[mt][i >> 1];"]


def _p_fragment_lines(plan: AttentionPlan) -> list[str]:
  """`p`: P's A fragments (16-bit) of keys 16 kk.. of every m tile: two neighbouring n tiles of P's accumulators are
  one A fragment of m16n8k16 as they are, rounded to the operand type."""
  return [f"      unsigned p[{plan.warp_tiles}][4];",
          *_each_tile("{ p[mt][0] = pack_floats(scores[mt][2 * kk][0], scores[mt][2 * kk][1]); "
                      "p[mt][1] = pack_floats(scores[mt][2 * kk][2], scores[mt][2 * kk][3]); "
                      "p[mt][2] = pack_floats(scores[mt][2 * kk + 1][0], scores[mt][2 * kk + 1][1]); "
                      "p[mt][3] = pack_floats(scores[mt][2 * kk + 1][2], scores[mt][2 * kk + 1][3]); }",
                      plan, "      ")]


def _weighted_sum_lines(plan: AttentionPlan) -> list[str]:
  """O += P V, each V fragment used by every m tile of the warp. TF32: a lane holds P columns 2q, 2q+1 of each 8 keys
  but m16n8k8's A wants columns q, q+4: the keys are taken in the order 0, 2, 4, 6, 1, 3, 5, 7 instead (column c of
  A is key pi(c), pi(q) = 2q, pi(q + 4) = 2q + 1), and B's rows (value rows) in the same order, which leaves the sum
  unchanged."""
  d_tiles, pitch = plan.head_dim // 8, plan.row_pitch
  if plan.dtype == "float32":
    return ["#pragma unroll",
            f"    for (int n = 0; n < {plan.block_n // 8}; n++) {{",
            f"      unsigned p[{plan.warp_tiles}][4];",
            *_each_tile("{ p[mt][0] = tf32(scores[mt][n][0]); p[mt][1] = tf32(scores[mt][n][2]); "
                        "p[mt][2] = tf32(scores[mt][n][1]); p[mt][3] = tf32(scores[mt][n][3]); }", plan, "      "),
            f"      const float* value_rows = v_stage + (n * 8 + quad * 2) * {pitch} + group;",
            "#pragma unroll",
            f"      for (int d = 0; d < {d_tiles}; d++) {{",
            f"        unsigned b0 = tf32(value_rows[d * 8]), b1 = tf32(value_rows[{pitch} + d * 8]);",
            *_each_tile("mma(outputs[mt][d], p[mt], b0, b1);", plan, "        "),
            "      }",
            "    }"]
  if plan.ldmatrix: return _weighted_sum_ldmatrix_lines(plan)
  return ["#pragma unroll",
          f"    for (int kk = 0; kk < {plan.block_n // 16}; kk++) {{",
          *_p_fragment_lines(plan),
          f"      const unsigned short* value_rows = v_stage + (kk * 16 + quad * 2) * {pitch} + group;",
          "#pragma unroll",
          f"      for (int d = 0; d < {d_tiles}; d++) {{",
          "        const unsigned short* column = value_rows + d * 8;",
          f"        unsigned b0 = pack_bits(column[0], column[{pitch}]);",
          f"        unsigned b1 = pack_bits(column[{8 * pitch}], column[{9 * pitch}]);",
          *_each_tile("mma(outputs[mt][d], p[mt], b0, b1);", plan, "        "),
          "      }",
          "    }"]


def _weighted_sum_ldmatrix_lines(plan: AttentionPlan) -> list[str]:
  """O += P V (16-bit), V's B fragments by ldmatrix.x4.trans: matrices (keys 0-7, keys 8-15 of the 16) x (value
  columns of d tile d, then d + 1); a lane gets a key pair of one column, B's layout."""
  return ["#pragma unroll",
          f"    for (int kk = 0; kk < {plan.block_n // 16}; kk++) {{",
          *_p_fragment_lines(plan),
          # lane l: row l % 8 of matrix l / 8 (keys 8 ((l / 8) % 2).., columns of d tile d + l / 16)
          f"      const unsigned short* rows = v_stage + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * "
          f"{plan.row_pitch} + (lane >> 4) * 8;",
          "#pragma unroll",
          f"      for (int d = 0; d < {plan.head_dim // 8}; d += 2) {{",
          "        unsigned b[4];",
          "        load_matrices_transposed(b, rows + d * 8);",
          *_each_tile("{ mma(outputs[mt][d], p[mt], b[0], b[1]); mma(outputs[mt][d + 1], p[mt], b[2], b[3]); }",
                      plan, "        "),
          "      }",
          "    }"]


def _store_lines(plan: AttentionPlan) -> list[str]:
  """O / sum into (B, L, H, D) in the operand type (16-bit: a lane's column pair rounded into one 32-bit store) and
  the float32 logsumexp into (B, H, L) after it, rows past L left out."""
  d_tiles, heads, dim = plan.head_dim // 8, plan.heads, plan.head_dim
  storage = STORAGE_TYPE[plan.dtype]
  if plan.dtype == "float32":
    store = ["      float2 pair = make_float2(outputs[mt][d][half * 2] * inverse, "
             "outputs[mt][d][half * 2 + 1] * inverse);",
             "      *(float2*)(out_row + d * 8 + quad * 2) = pair;"]
  else:
    store = ["      *(unsigned*)(out_row + d * 8 + quad * 2) = "
             "pack_floats(outputs[mt][d][half * 2] * inverse, outputs[mt][d][half * 2 + 1] * inverse);"]
  return ["#pragma unroll",
          f"  for (int mt = 0; mt < {plan.warp_tiles}; mt++)",
          "#pragma unroll",
          "  for (int half = 0; half < 2; half++) {",
          "    float total = row_sum[mt][half];",
          "    total += __shfl_xor_sync(0xffffffffu, total, 1);",
          "    total += __shfl_xor_sync(0xffffffffu, total, 2);",
          f"    int row = first_row + mt * {WARP_ROWS} + half * 8;",
          f"    if (row >= {plan.length}) continue;",
          "    float inverse = 1.0f / total;",
          f"    {storage}* out_row = out + ((long long)(batch * {plan.length} + row) * {heads} + head) * {dim};",
          "#pragma unroll",
          f"    for (int d = 0; d < {d_tiles}; d++) {{",
          *store,
          "    }",
          f"    if (quad == 0) ((float*)out)[{plan.lse_offset}ll + (long long)(batch * {heads} + head) * {plan.length} "
          f"+ row] = (row_max[mt][half] + log2f(total)) * {LN_2!r}f;",
          "  }"]


def _stage_lines(plan: AttentionPlan) -> list[str]:
  """k_stage and v_stage: this tile's staged keys and values (wgmma: their shared addresses)."""
  if plan.mma == "wgmma":
    return [f"    unsigned k_stage = shared_base + (tile % {plan.stages}) * {attention_wgmma.stage_bytes(plan)}, "
            f"v_stage = k_stage + {attention_wgmma.tile_bytes(plan)};"]
  storage = STORAGE_TYPE[plan.dtype]
  return [f"    const {storage}* k_stage = k_tiles + (tile % {plan.stages}) * {plan.tile_elements};",
          f"    const {storage}* v_stage = v_tiles + (tile % {plan.stages}) * {plan.tile_elements};"]


def render_attention(plan: AttentionPlan, name: str | None = None, arguments: dict[str, int] | None = None,
                     dynamic_shared_symbol: str = "ourgrad_dynamic_shared_bytes", helpers: str | None = None) -> str:
  """CUDA C++ (NVRTC, sm_80+) of the fused attention kernel `name` (default plan.name); its buffers in the order
  `arguments` gives (default out, q, k, v); launch with plan.global_size x plan.local_size and plan.shared_bytes of
  dynamic shared memory (exported as `dynamic_shared_symbol`, which ourgrad's CUDA runtime reads at load)."""
  arguments = arguments or {"out": 0, "q": 1, "k": 2, "v": 3}
  storage, wgmma = STORAGE_TYPE[plan.dtype], plan.mma == "wgmma"
  last_tile = f"(block_first_row + {plan.block_m - 1}) / {plan.block_n}"
  tiles = f"min({math.ceil(plan.source / plan.block_n)}, {last_tile} + 1)" if plan.causal else \
      f"{math.ceil(plan.source / plan.block_n)}"
  lines = [
    f'extern "C" __device__ unsigned int {dynamic_shared_symbol} = {plan.shared_bytes};',
    "extern __shared__ __align__(16) unsigned char attention_shared[];",
    "#define NEG_INF __int_as_float(0xff800000)",
    kernel_helpers(plan) if helpers is None else helpers,
    *_signature(plan, name or plan.name, arguments),
    *(["  unsigned shared_base = (shared_address(attention_shared) + 1023u) & ~1023u;"] if wgmma else
      [f"  {storage}* k_tiles = ({storage}*)attention_shared;",
       f"  {storage}* v_tiles = k_tiles + {plan.stages * plan.tile_elements};"]),
    "  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group = lane >> 2, quad = lane & 3;",
    f"  const float scale_log2 = {plan.scale * LOG2_E!r}f;",
  ]
  item = [*_block_index_lines(plan),
          f"  int kv_head = head / {plan.group};",
          f"  int block_first_row = query_block * {plan.block_m};",
          f"  int first_row = block_first_row + warp * {plan.warp_rows} + group;",
          f"  const {storage}* q_base = q_buffer + {_element_offset(plan.q, 'batch', 'head')};",
          f"  const {storage}* k_base = k_buffer + {_element_offset(plan.k, 'batch', 'kv_head')};",
          f"  const {storage}* v_base = v_buffer + {_element_offset(plan.v, 'batch', 'kv_head')};"]
  if plan.persistent:
    lines += attention_wgmma.persistent_lines(plan, [*item, f"  int tiles = {tiles};"], _consumer_item_lines(plan))
    return "\n".join(line for line in [*lines, "}"] if line) + "\n"
  lines += [
    *item,
    # (a producer warpgroup copies the tiles from here on and leaves; the consumers go on)
    *([f"  int tiles = {tiles};", *attention_wgmma.producer_lines(plan)] if plan.producer else []),
    *_consumer_item_lines(plan, tiles),
    "}",
  ]
  return "\n".join(line for line in lines if line) + "\n"


def _consumer_item_lines(plan: AttentionPlan, tiles: str = "") -> list[str]:
  """One query block's work after its copies are under way: Q, O's accumulators and the row statistics set up, the
  loop over key tiles (without a producer: copy_tile and the first tile's copies first, `tiles` named here), the
  store."""
  wgmma = plan.mma == "wgmma"
  return [
    *(attention_wgmma.own_q_lines(plan) if plan.q_shared and plan.producer else
      [] if plan.q_shared else _q_fragment_lines(plan)),
    f"  float outputs[{plan.warp_tiles}][{plan.head_dim // 8}][4], row_max[{plan.warp_tiles}][2], "
    f"row_sum[{plan.warp_tiles}][2];",
    "#pragma unroll",
    f"  for (int mt = 0; mt < {plan.warp_tiles}; mt++) {{",
    "#pragma unroll",
    f"    for (int d = 0; d < {plan.head_dim // 8}; d++) outputs[mt][d][0] = outputs[mt][d][1] = outputs[mt][d][2] = "
    "outputs[mt][d][3] = 0.0f;",
    "    row_max[mt][0] = row_max[mt][1] = NEG_INF;",
    "    row_sum[mt][0] = row_sum[mt][1] = 0.0f;",
    "  }",
    *(_consumer_loop_lines(plan) if plan.producer else [
      *(attention_wgmma.copy_tile_lines(plan) if wgmma else _copy_tile_lines(plan)),
      *(attention_wgmma.copy_q_lines(plan) if plan.q_shared else []),
      f"  int tiles = {tiles};",
      "  copy_tile(0, 0);",
      *(attention_wgmma.overlapped_loop_lines(plan, _mask_lines(plan), _softmax_lines(plan, deferred=True),
                                              _rescale_lines(plan)) if plan.overlap else _loop_lines(plan))]),
    *_store_lines(plan)]


def _block_index_lines(plan: AttentionPlan) -> list[str]:
  """query_block, head and batch of this CTA. Causal: CTAs start in the order of their linear index (x fastest), and
  that index counts the query blocks down across every (batch, head) before the next block (all the last blocks, the
  longest, first; then the next ones), so the grid's tail is the shortest CTAs wherever a head's rows fall (by the
  grid's own x, y, z each head would run its longest block beside others' short ones, to the end)."""
  pairs = plan.heads * plan.batch
  if plan.persistent and not plan.causal:   # (a persistent CTA's `order`: attention_wgmma._rounds)
    return [f"  int query_block = order / {pairs}, head = order % {plan.heads}, "
            f"batch = order % {pairs} / {plan.heads};"]
  if not plan.causal: return ["  int query_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;"]
  return [*([] if plan.persistent else
            [f"  int order = blockIdx.x + {plan.query_blocks} * (blockIdx.y + {plan.heads} * blockIdx.z);"]),
          f"  int query_block = {plan.query_blocks - 1} - order / {pairs};",
          f"  int head = order % {plan.heads}, batch = order % {pairs} / {plan.heads};"]


def _consumer_loop_lines(plan: AttentionPlan) -> list[str]:
  """The consumer warpgroups' loop over the tiles a producer warpgroup copies (attention_wgmma.producer_lines)."""
  if plan.overlap:
    return attention_wgmma.overlapped_loop_lines(plan, _mask_lines(plan), _softmax_lines(plan, deferred=True),
                                                 _rescale_lines(plan))
  return attention_wgmma.consumer_loop_lines(plan, _mask_lines(plan), _softmax_lines(plan))


def _loop_lines(plan: AttentionPlan) -> list[str]:
  """The loop over key tiles: the next tile's copies issued, this one's awaited, S, the softmax, O += P V."""
  wgmma = plan.mma == "wgmma"
  return [
    "  for (int tile = 0; tile < tiles; tile++) {",
    # the next tile streams in while this one is computed
    f"    if (tile + 1 < tiles) copy_tile(tile + 1, (tile + 1) % {plan.stages});",
    *(["    else copy_commit();", "    copy_wait_all_but_one();"] if plan.vector_copies else []),
    # (wgmma: the copies' writes made visible to the tensor cores' async proxy before the barrier)
    *(["    async_proxy_fence();"] if wgmma else []),
    "    __syncthreads();",
    *_stage_lines(plan),
    *(attention_wgmma.scores_lines(plan) + _mask_lines(plan) if wgmma else _scores_lines(plan)),
    *_softmax_lines(plan),
    *(attention_wgmma.weighted_sum_lines(plan) if wgmma else _weighted_sum_lines(plan)),
    # every warp is done with this stage before a later copy_tile overwrites it. With 3 stages or more the next
    # iteration's copy goes to a stage no warp can still read: a warp past that iteration's barrier knows every warp
    # has finished the tile before this one, and this one's stage is not the copy's
    *(["    __syncthreads();"] if plan.stages < 3 else []),
    "  }"]

