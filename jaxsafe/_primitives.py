"""The rows of the primitive table: every fact the rewrite knows about each primitive.

Families are registered together (`register_elementwise`, `register_movement`, ...), each row
naming only what differs from the family. To find everything about a primitive, find its name
here. To add one:

- an elementwise primitive: `register_elementwise(p, ...)` with its guard and bound, if any;
- a NaN-prone primitive of your own: `jaxsafe.register_guard(p, safe)` (elementwise);
- a primitive that moves lanes: `register(p, masks=..., ...)` with a mask rule from
  `_liveness_rules.py` (`by_transpose_masks` works for any linear data movement), and
  `linear=True` if its derivative never multiplies a cotangent by an operand's value.

A primitive without a row is treated conservatively (`_rules.rule_for`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax import lax
from jax.lax import linalg as lax_linalg

from . import _bounds as bounds
from . import _ranges as ranges
from . import _zero_lanes as zero_lanes
from ._atoms import dtype_of, literal_value
from ._backward import SeededBackward
from ._bodies import CondBody, RematBody, ScanBody
from ._carries import (
    moved_lanes,
    moved_static,
    product_lanes,
    product_static,
    reduced_lanes,
    winner_lanes,
    winner_static,
)
from ._case_index import first_true_of_argmax, rows_of_concatenate, rows_of_stack
from ._choosers import (
    by_fill,
    by_held,
    by_original,
    by_original_contraction,
    by_permutation,
    by_top_k,
    by_wins,
    comparison_masks,
    contraction_applies,
    contraction_masks,
    contraction_syms,
    product_applies,
    product_masks,
    product_syms,
    reads_as,
    row_reads,
    running_choice,
    scatter_choice_masks,
    scatter_choice_syms,
    sort_masks,
    support_masks,
    window_choice,
    window_reads,
)
from ._compat import (
    PRIVATE_KEY_WRAPS,
    PRIVATE_LINEAR_COLLECTIVES,
    PRIVATE_OTHER_COLLECTIVES,
    PRIVATE_PLATFORM_INDEX,
    PRIVATE_RESHARDS,
    PRIVATE_VARY_CASTS,
    JaxprEqn,
    Literal,
    Primitive,
    shard_map_body_context,
    shard_map_p,
    transpose_to_zero_where_missing,
)
from ._compat import primitives as prims
from ._custom_carries import (
    custom_jvp_held,
    custom_jvp_lanes,
    custom_jvp_selects,
    custom_jvp_static,
)
from ._custom_rules import (
    confirms_selections,
    custom_jvp_kinds,
    custom_jvp_masks,
    custom_jvp_syms,
    derivative_program,
    rechoose,
    weighs_tangents,
    writes_its_zeros,
)
from ._diagonal import (
    broadcast_diagonal,
    difference_diagonal,
    elementwise_diagonal,
    reduced_diagonal,
    selected_diagonal,
)
from ._dropped import chosen_scalar, reshaped_scalar, same_scalar, summed_scalar
from ._free import moved_held, product_held, summed_held, winner_held
from ._lanewise import scan_kinds, scan_loop_links, scan_masks, scan_syms, while_loop_links
from ._liveness_rules import (
    CONVOLUTION,
    WINDOW_SUM,
    aligned_lanes_syms,
    aligned_syms,
    along_axes_syms,
    as_twin,
    batched_alignment,
    batched_masks,
    batched_syms,
    broadcast_in_dim_alignment,
    broadcast_in_dim_masks,
    by_transpose_masks,
    call_kinds,
    call_masks,
    call_syms,
    clamp_wins,
    concatenate_masks,
    concatenate_syms,
    concatenated_axis,
    cond_kinds,
    cond_masks,
    convolution_alignment,
    cumulative_axis,
    cumulative_masks,
    custom_rule_kinds,
    custom_rule_masks,
    custom_rule_syms,
    dot_general_alignment,
    dynamic_slice_syms,
    dynamic_sliced_axes,
    dynamic_update_slice_syms,
    elementwise_masks,
    gather_masks,
    gather_syms,
    max_wins,
    min_wins,
    opaque_call_kinds,
    opaque_call_masks,
    out_of_range_drops,
    pad_drops,
    pad_syms,
    padded_axes,
    paired_masks,
    paired_syms,
    reduce_alignment,
    reduce_masks,
    reduction_alignment,
    reduction_masks,
    reshape_alignment,
    reshape_masks,
    reshape_syms,
    rev_syms,
    reversed_axes,
    same_rank_alignment,
    scatter_add_syms,
    scatter_masks,
    scatter_syms,
    select_masks,
    select_syms,
    selected_syms,
    slice_masks,
    slice_syms,
    sliced_axes,
    solve_masks,
    solve_syms,
    sort_axis,
    split_axis,
    split_masks,
    split_syms,
    squeeze_alignment,
    squeeze_masks,
    stack_masks,
    stack_syms,
    tile_masks,
    tiled_axes,
    top_k_axis,
    transpose_alignment,
    transpose_masks,
    unstack_masks,
    updated_axes,
    window_axes,
    window_drops,
    windowed_masks,
    winner_masks,
)
from ._maxima import reduced_by_a_max
from ._nested import branch_jaxpr, default_platform_case
from ._rules import Carries, Chooser, Guard, Selection, Zeros, register, update
from ._sinking import ScanSteps
from ._symbolic import Connective
from ._taint import (
    compared_with_nonfinite,
    computation_selects,
    cond_body_inputs,
    cond_body_operands,
    direct_body_inputs,
    direct_body_operands,
    every_operand,
    exponent_set_by,
    fills_nonfinite,
    indices_in_range,
    not_nan_where_false,
    not_nan_where_true,
    reduces_an_empty_axis,
    scan_body_inputs,
    scan_body_operands,
    sliced_body_operands,
    while_body_inputs,
    while_body_operands,
    window_may_read_padding_only,
)


def _always(eqn: JaxprEqn) -> bool:
    return True


def _fft_core(eqn: JaxprEqn) -> int:
    return len(eqn.params["fft_lengths"])


def register_elementwise(*primitives: Primitive, **facts: Any) -> None:
    """Lane-to-lane primitives; a broadcast operand is live where any lane it feeds is."""
    family = dict(masks=elementwise_masks, align=same_rank_alignment, static=aligned_syms,
                  elementwise=True, foldable=True, diagonal=elementwise_diagonal)
    register(*primitives, **{**family, **facts})


def register_movement(*primitives: Primitive, **facts: Any) -> None:
    """Primitives that move lanes without computing on them: linear, evaluable on constants."""
    register(*primitives, **{"linear": True, "foldable": True, "moves_only": True, **facts})


def register_reduction(*primitives: Primitive, **facts: Any) -> None:
    """Every lane of a reduced row is live if the row's result is."""
    family = dict(masks=reduction_masks, align=reduction_alignment, static=aligned_syms,
                  foldable=True)
    register(*primitives, **{**family, **facts})


def register_selection(primitive: Primitive, **facts: Any) -> None:
    """Primitives that pick one operand's value per lane: the others' lanes are dropped."""
    family = dict(align=same_rank_alignment, drops=_always, linear=True, foldable=True)
    register(primitive, **{**family, **facts})


def _negative_exponent(eqn: JaxprEqn) -> bool:
    return eqn.params["y"] < 0


def _no_nonzero_literal(eqn: JaxprEqn) -> bool:
    """`atan2` is singular only where both operands are 0: never against a nonzero constant
    (`arctan2(x, 1.)`; its derivative's denominator is at least that constant squared)."""
    return not any(isinstance(a, Literal) and np.all(np.asarray(literal_value(a)) != 0)
                   for a in eqn.invars)


def _complex_operand(eqn: JaxprEqn) -> bool:
    return np.issubdtype(dtype_of(eqn.invars[0]), np.complexfloating)


# Lanes that carry no derivative (`_carries.py`, `_free.py`): constants moved in, constants that
# win a comparison (re-decided as a `select_n` below a NaN-prone primitive, `_cotangents.py`),
# zero factors that carry nothing.
MOVED = Carries(moved_static, moved_lanes, moved_held)
WINNER = Carries(winner_static, winner_lanes, winner_held)
PRODUCT = Carries(product_static, product_lanes, product_held, selects=False)
SUMMED = Carries(moved_static, reduced_lanes, summed_held)

ONE = Guard({0: 1.0})  # roots, logs, poles at 0 and below: 1 is inside every domain
ZERO = Guard({0: 0.0})  # overflow, inverse trig: the middle of the domain
# singular only where the value is inf or NaN too (a pole, log at 0, an overflow): a lane that
# carries no derivative shows it in the forward value and takes no forward-mode guard
POLE_AT_ONE = Guard({0: 1.0}, finite_at_singularities=False)
POLE_AT_ZERO = Guard({0: 0.0}, finite_at_singularities=False)
ZEROTH = frozenset({0})  # `PrimitiveRule.at_least`: the output is at least operand 0

# --------------------------------------------------------------------------- elementwise
# NaN-prone (the guard table): each listed operand takes the safe value in dropped lanes.
register_elementwise(prims.sqrt_p, guard=ONE, decreasing=True, bound=bounds.root,
                     preimage=bounds.root_preimage, range=ranges.root_range)
register_elementwise(prims.cbrt_p, guard=ONE, decreasing=True)
register_elementwise(prims.rsqrt_p, prims.log_p, guard=POLE_AT_ONE, decreasing=True)
register_elementwise(prims.log1p_p, guard=POLE_AT_ZERO, decreasing=True, edge=-1.0)
register_elementwise(prims.div_p, guard=Guard({1: 1.0}, finite_at_singularities=False,
                                              apart=frozenset({1})), divisor=1,
                     bound=bounds.quotient, preimage=bounds.quotient_preimage,
                     range=ranges.quotient_range,
                     derivative_reads=(frozenset({1}), frozenset({0, 1})))
register_elementwise(prims.rem_p, guard=Guard({1: 1.0}, finite_at_singularities=False))
# x ** y: singular at 0 for y < 1, NaN below; a whole y too, past its order: JAX's derivative
# y * x ** (y - 1) selects 0 where y == 0, and the untaken x ** -1 is inf at x = 0 (the third
# reverse-mode derivative of x ** 2. at 0 is NaN)
# a constant base in the domain still overflows for a large exponent (`10. ** n`): the base's
# guard, 1, makes it finite whatever the exponent
register_elementwise(prims.pow_p, guard=Guard({0: 1.0}, overflows_through=frozenset({1})),
                     ranged_operand=0, range=ranges.power_range)
register_elementwise(prims.integer_pow_p,
                     guard=Guard({0: 1.0}, _negative_exponent, finite_at_singularities=False),
                     bound=bounds.even_power, range=ranges.even_power_range)
register_elementwise(prims.abs_p, guard=Guard({0: 1.0}, _complex_operand),
                     bound=bounds.absolute, range=ranges.absolute_range)
register_elementwise(prims.acos_p, prims.asin_p, guard=ZERO)
register_elementwise(prims.atanh_p, prims.erf_inv_p, guard=POLE_AT_ZERO)
register_elementwise(prims.acosh_p, guard=Guard({0: 2.0}))
# each safe value alone is off the singular origin: an operand that keeps its value (a scalar
# broadcast into a live lane, one that carries no derivative) never meets 0 from the other
register_elementwise(prims.atan2_p, guard=Guard({0: 1.0, 1: 1.0}, _no_nonzero_literal))
# overflow: inf in the forward, inf * 0 = NaN in the backward
register_elementwise(prims.exp_p, guard=POLE_AT_ZERO, bound=bounds.non_negative, increasing=True,
                     range=ranges.exp_range)
register_elementwise(prims.exp2_p, guard=POLE_AT_ZERO, bound=bounds.non_negative,
                     increasing=True, range=ranges.exp2_range)
register_elementwise(prims.expm1_p, guard=POLE_AT_ZERO, increasing=True, range=ranges.expm1_range)
register_elementwise(prims.sinh_p, prims.cosh_p, prims.tan_p, guard=POLE_AT_ZERO)
# special functions with poles at the non-positive integers
register_elementwise(prims.lgamma_p, prims.digamma_p, guard=POLE_AT_ONE)
register_elementwise(prims.polygamma_p, guard=Guard({1: 1.0}, finite_at_singularities=False),
                     no_derivative=frozenset({0}))
register_elementwise(prims.igamma_p, prims.igammac_p, guard=Guard({0: 1.0, 1: 1.0}))
register_elementwise(prims.igamma_grad_a_p, guard=Guard({0: 1.0, 1: 1.0}),
                     no_derivative=frozenset({0, 1}))
# `jax.random.gamma` (and `beta`, `dirichlet`): a sample per lane of `a` (operand 1), each
# from its own key (operand 0, one key split per lane, or a key per lane): a finite shape
# outside (0, inf) makes NaN, and its derivative (the implicit reparameterization's) with it;
# 1.0 samples an exponential. Not folded: it samples.
register_elementwise(prims.random_gamma_p, guard=Guard({1: 1.0}), no_derivative=frozenset({0}),
                     foldable=False)
register_elementwise(prims.zeta_p, guard=Guard({0: 2.0, 1: 1.0}), no_derivative=frozenset({0, 1}))
register_elementwise(prims.regularized_incomplete_beta_p,
                     guard=Guard({0: 1.0, 1: 1.0, 2: 0.5}), no_derivative=frozenset({0, 1}))

# finite for every finite input
register_elementwise(prims.add_p, linear=True, bound=bounds.of_all(max),
                     preimage=bounds.sum_preimage, range=ranges.sum_range)
register_elementwise(prims.sub_p, linear=True, preimage=bounds.difference_preimage,
                     range=ranges.difference_range, diagonal=difference_diagonal, difference=True)
register_elementwise(prims.neg_p, linear=True, range=ranges.negated_range)
register_elementwise(prims.add_jaxvals_p, prims.real_p, prims.imag_p, prims.complex_p,
                     prims.conj_p, linear=True)
BILINEAR = (frozenset({1}), frozenset({0}))  # each operand's derivative is the other operand
# a factor that carries no derivative masks the other where it is 0 (`_choosers.py`)
register_elementwise(prims.mul_p, bound=bounds.product, preimage=bounds.product_preimage,
                     range=ranges.product_range,
                     derivative_reads=BILINEAR, carries=PRODUCT,
                     masks=product_masks, static=product_syms,
                     chooser=Chooser(by_original, product_applies))
register_elementwise(prims.square_p, bound=bounds.non_negative, range=ranges.square_range)
register_elementwise(prims.convert_element_type_p, linear=True, bound=bounds.converted,
                     casts=True,
                     preimage=bounds.same_preimage, range=ranges.converted_range)
register_elementwise(prims.reduce_precision_p, linear=True,
                     bound=bounds.non_negative_if_bounded)
register_elementwise(prims.copy_p, linear=True, bound=bounds.moved, at_least=ZEROTH,
                     preimage=bounds.same_preimage, range=ranges.same_range)
# `checkpoint_name`: the value itself, tagged for a remat policy (a drop after it reaches the
# value before it: without this row, `where(m, checkpoint_name(log(x)), 0.)` went unguarded)
register_elementwise(prims.name_p, linear=True, bound=bounds.moved,
                     preimage=bounds.same_preimage, range=ranges.same_range)
# `jax.device_put` and `lax.optimization_barrier` inside a traced function: each operand is
# its output, placed or fenced (without these rows a drop after them did not reach the value
# before them: `where(m, device_put(log(x)), 0.)` went unguarded)
register(prims.device_put_p, lax.optimization_barrier_p, masks=paired_masks,
         static=paired_syms, linear=True, paired=True)
# `with_sharding_constraint`: the value itself, placed; re-emitted with its sharding
register_elementwise(prims.sharding_constraint_p, linear=True, bound=bounds.moved)
# `reshard` (Explicit mesh axes): where its operand and output are typed with different
# shardings a mask cannot cross it unchanged (a select of differently sharded operands is an
# error): every operand lane is live where any output lane is. An identity reshard (the same
# sharding both sides, as `jnp.where` with a scalar case traces under `jax.set_mesh`) is the
# value itself, placed: its mask crosses (`paired_masks`)
register(*PRIVATE_RESHARDS, masks=paired_masks, static=paired_syms, linear=True, paired=True)
register(*PRIVATE_PLATFORM_INDEX, zero_derivative=True, fixed_index=default_platform_case)
# No liveness facts, but finite for finite operands (a primitive without a row may make NaN or
# inf: `CONSERVATIVE`): picks and updates of finite values, random numbers, decompositions and
# integer arithmetic. `bitcast_convert_type`: integer bits make any float, unless a constant
# sets the exponent (`jax.random.uniform`)
register(prims.bitcast_convert_type_p, makes_nonfinite=True,
         finite_when=exponent_set_by(prims.or_p, prims.shift_right_logical_p))
register(prims.rng_uniform_p, repeatable=False)  # XLA's RngUniform: a new draw each time
register(prims.select_and_gather_add_p, prims.select_and_scatter_add_p,
         prims.select_and_scatter_p,
         prims.random_bits_p, prims.random_seed_p,
         prims.random_fold_in_p, prims.random_split_p, prims.rng_bit_generator_p,
         prims.threefry2x32_p, prims.hessenberg_p, prims.schur_p, prims.tridiagonal_p,
         prims.clz_p, prims.population_count_p, prims.shift_left_p, prims.shift_right_arithmetic_p,
         prims.shift_right_logical_p, prims.create_token_p, prims.after_all_p)
# row by row, as a sum: the rows a dropped result reduces are dropped too (a custom rule's body
# that tests its pivots, `slogdet`'s `any(diag == 0)`, read as one unit)
register_reduction(prims.reduce_and_p, prims.reduce_or_p, prims.reduce_xor_p, prims.argmin_p)
register_reduction(prims.argmax_p, first_true=first_true_of_argmax)
if hasattr(lax, "mulhi_p"):  # JAX 0.10 on
    register(lax.mulhi_p)
# integer pivots to a permutation (`lu_solve`, `lu_factor`): no float, no derivative
register(lax_linalg.lu_pivots_to_permutation_p)
register(*PRIVATE_KEY_WRAPS)  # key data <-> typed key: no float, nothing made non-finite
register_elementwise(prims.asinh_p, prims.bessel_i0e_p, prims.bessel_i1e_p)
# bounded for every finite operand: `jnp.log(jax.nn.sigmoid(x) + 1e-7)` is in `log`'s domain
register_elementwise(prims.tanh_p, prims.sin_p, prims.cos_p, prims.erf_p,
                     range=ranges.between(-1.0, 1.0))
register_elementwise(prims.logistic_p, bound=bounds.non_negative, range=ranges.between(0.0, 1.0))
register_elementwise(prims.erfc_p, bound=bounds.non_negative, range=ranges.between(0.0, 2.0))
register_elementwise(prims.atan_p, range=ranges.between(-np.pi / 2, np.pi / 2))
register_elementwise(prims.nextafter_p, no_derivative=frozenset({0, 1}))
# zero derivative: operands are read for their value only
register_elementwise(prims.stop_gradient_p, zero_derivative=True, linear=True,
                     bound=bounds.moved, at_least=ZEROTH, holds_operand=True)
transpose_to_zero_where_missing(prims.stop_gradient_p)  # jax-ml/jax#22011, under vmap of a cond
register_elementwise(prims.sign_p, prims.floor_p, prims.ceil_p, prims.round_p,
                     zero_derivative=True)
register_elementwise(prims.is_finite_p, zero_derivative=True, tests_nonfinite=every_operand,
                     true_where_finite=True, not_nan_where=not_nan_where_true)
# comparisons and logic: no tangent, but in structural mode every read counts
register_elementwise(prims.eq_p, tests_nonfinite=compared_with_nonfinite, equality=True,
                     not_nan_where=not_nan_where_true)
register_elementwise(prims.ne_p, tests_nonfinite=compared_with_nonfinite,
                     not_nan_where=not_nan_where_false)
register_elementwise(prims.lt_p, prims.le_p, prims.gt_p, prims.ge_p,
                     tests_nonfinite=compared_with_nonfinite)
register_elementwise(prims.and_p, connective=Connective.AND)
register_elementwise(prims.or_p, connective=Connective.OR)
register_elementwise(prims.not_p, connective=Connective.NOT)
register_elementwise(prims.xor_p)

# --------------------------------------------------------------------------- selections
register_selection(prims.select_n_p, masks=select_masks, static=select_syms,
                   selection=Selection(by_predicate=True),
                   bound=bounds.of_cases, diagonal=selected_diagonal)
# max, min, clamp are not linear, but their derivative only selects (weights 0, 1/2, 1 from
# comparisons): a NaN operand never meets a cotangent in a product, and a guard there would
# bend the decision.
register_selection(prims.max_p, masks=winner_masks, static=selected_syms, carries=WINNER,
                   selection=Selection(by_predicate=False, wins=max_wins, larger_wins=True),
                   chooser=Chooser(by_wins), identity=-np.inf, bound=bounds.largest_known,
                   range=ranges.max_range, at_least=frozenset({0, 1}))
register_selection(prims.min_p, masks=winner_masks, static=selected_syms, carries=WINNER,
                   selection=Selection(by_predicate=False, wins=min_wins, larger_wins=False),
                   chooser=Chooser(by_wins), identity=np.inf, range=ranges.min_range,
                   bound=bounds.smallest)
register_selection(prims.clamp_p, masks=winner_masks, static=selected_syms, carries=WINNER,
                   selection=Selection(by_predicate=False, wins=clamp_wins),
                   chooser=Chooser(by_wins), bound=bounds.clamped)

# --------------------------------------------------------------------------- data movement
register_movement(prims.slice_p, masks=slice_masks, static=slice_syms, drops=_always,
                  works_along=sliced_axes,
                  bound=bounds.moved, carries=MOVED)
register_movement(prims.gather_p, masks=gather_masks, static=gather_syms, drops=_always,
                  carries=MOVED, nonfinite_when=fills_nonfinite, finite_when=indices_in_range)
register_movement(prims.dynamic_slice_p, masks=by_transpose_masks, static=dynamic_slice_syms,
                  drops=_always, works_along=dynamic_sliced_axes, carries=MOVED)
register_movement(prims.dynamic_update_slice_p, masks=by_transpose_masks, drops=_always,
                  static=dynamic_update_slice_syms, carries=MOVED,
                  works_along=updated_axes)
register_movement(prims.pad_p, masks=by_transpose_masks, static=pad_syms, drops=pad_drops,
                  carries=MOVED, works_along=padded_axes)
register_movement(prims.rev_p, masks=by_transpose_masks, static=rev_syms, carries=MOVED,
                  works_along=reversed_axes)
register_movement(prims.transpose_p, masks=transpose_masks, align=transpose_alignment,
                  static=aligned_syms, bound=bounds.moved, range=ranges.same_range,
                  carries=MOVED)
register_movement(prims.reshape_p, masks=reshape_masks, align=reshape_alignment,
                  static=reshape_syms, scalar_move=reshaped_scalar, bound=bounds.moved,
                  range=ranges.same_range, carries=MOVED, at_least=ZEROTH)
register_movement(prims.squeeze_p, masks=squeeze_masks, align=squeeze_alignment,
                  static=aligned_syms, scalar_move=same_scalar, bound=bounds.moved,
                  range=ranges.same_range, carries=MOVED, at_least=ZEROTH)
register_movement(prims.broadcast_in_dim_p, masks=broadcast_in_dim_masks,
                  align=broadcast_in_dim_alignment, static=aligned_syms, broadcast=True,
                  scalar_move=same_scalar, bound=bounds.moved, range=ranges.same_range,
                  diagonal=broadcast_diagonal, at_least=ZEROTH)
register_movement(prims.concatenate_p, masks=concatenate_masks, static=concatenate_syms,
                  carries=MOVED, works_along=concatenated_axis, stacked_rows=rows_of_concatenate)
if hasattr(lax, "split_p"):
    register_movement(lax.split_p, masks=split_masks, static=split_syms,
                      works_along=split_axis)
# `jnp.stack`, `jnp.unstack` and `jnp.tile` bind primitives of their own in newer JAX
if hasattr(lax, "stack_p"):
    register_movement(lax.stack_p, masks=stack_masks, static=stack_syms, carries=MOVED,
                      stacked_rows=rows_of_stack)
if hasattr(lax, "unstack_p"):
    register_movement(lax.unstack_p, masks=unstack_masks)
if hasattr(lax, "tile_p"):
    register_movement(lax.tile_p, masks=tile_masks, static=along_axes_syms(tiled_axes),
                      carries=MOVED, works_along=tiled_axes)
# an overwrite drops the operand lanes it writes (and updates that a duplicate index overwrites)
register_movement(prims.scatter_p, masks=scatter_masks, static=scatter_syms,
                  drops=_always, carries=MOVED)
# an update lane is live where the output lane it adds to is (a gather of the output's mask:
# the transpose), and dropped where its index is out of range (`out_of_range_drops`)
register(prims.scatter_add_p, masks=scatter_masks, static=scatter_add_syms,
         drops=out_of_range_drops, linear=True, foldable=True)
# `x.at[i].subtract/multiply(u)`, `segment_prod`: read as the scatter-add with the same
# parameters (`as_twin`); finite for finite operands
register(lax.scatter_sub_p, prims.scatter_mul_p,
         masks=as_twin(prims.scatter_add_p, scatter_masks),
         static=as_twin(prims.scatter_add_p, scatter_add_syms), drops=out_of_range_drops)
# `x.at[i].max/min(u)`, `segment_max/min`: choosers (`_choosers.py`): only the lanes equal to
# their result are live, as a `reduce_max`'s
register(prims.scatter_min_p, prims.scatter_max_p,
         masks=scatter_choice_masks(as_twin(prims.scatter_add_p, scatter_masks)),
         static=scatter_choice_syms(as_twin(prims.scatter_add_p, scatter_add_syms)),
         drops=_always, chooser=Chooser(by_held, guarded_results=False))

# --------------------------------------------------------------------------- reductions
register_reduction(prims.reduce_sum_p, linear=True, scalar_move=summed_scalar,
                   bound=bounds.non_negative_if_bounded, range=ranges.non_negative_sum_range,
                   diagonal=reduced_diagonal, carries=SUMMED, sums=True)
# an index along one axis (`eye` compares two): no operand, no derivative
register(prims.iota_p, iota_axis=lambda eqn: eqn.params["dimension"], foldable=True)
# --------------------------------------------------------------------------- choosers
# Only the lanes their derivative chooses on the original values are live (`_choosers.py`).
FILL = Chooser(by_fill, keeps_dropped_values=False, meets_nan_only=True)

RUNNING_FILL = Chooser(by_fill, keeps_dropped_values=False, guarded_results=False)
for prim, identity in ((prims.reduce_max_p, -np.inf), (prims.reduce_min_p, np.inf)):
    register_reduction(prim, masks=comparison_masks(row_reads), static=selected_syms,
                       drops=_always, chooser=FILL, identity=identity,
                       scalar_move=chosen_scalar, diagonal=reduced_diagonal,
                       at_least=ZEROTH if identity < 0 else frozenset(),
                       nonfinite_when=reduces_an_empty_axis)
# a running maximum only grows: its choice is two cumulative ops, not a scan tree's derivative
register(prims.cummax_p, masks=comparison_masks(reads_as(prims.cumsum_p),
                                                running_choice(lax.cummin, +1)),
         static=along_axes_syms(cumulative_axis), works_along=cumulative_axis,
         drops=_always,
         chooser=RUNNING_FILL, identity=-np.inf, foldable=True)
register(prims.cummin_p, masks=comparison_masks(reads_as(prims.cumsum_p),
                                                running_choice(lax.cummax, -1)),
         static=along_axes_syms(cumulative_axis), works_along=cumulative_axis,
         drops=_always,
         chooser=RUNNING_FILL, identity=np.inf, foldable=True)
POOLED_READS = window_reads(prims.reduce_window_sum_p)
for prim, identity in ((prims.reduce_window_max_p, -np.inf), (prims.reduce_window_min_p, np.inf)):
    register(prim, masks=comparison_masks(POOLED_READS, window_choice(POOLED_READS)),
             static=along_axes_syms(window_axes), works_along=window_axes,
             drops=_always,
             chooser=Chooser(by_fill, keeps_dropped_values=False, picks=True,
                                     guarded_results=False),
             identity=identity, foldable=True, nonfinite_when=window_may_read_padding_only)
# a permutation of each row: a row whose sorted lanes are all live is live (no `drops`)
register(prims.sort_p, masks=sort_masks, chooser=Chooser(by_permutation),
         static=along_axes_syms(sort_axis), works_along=sort_axis, linear=True,
         foldable=True)
# `approx_max_k`/`approx_min_k`: the lanes it returns, as `top_k` (exact on CPU and GPU; on
# TPU, whatever it returns: JAX's derivative reads the returned indices)
register(prims.top_k_p, prims.approx_top_k_p, masks=support_masks, drops=_always,
         chooser=Chooser(by_top_k),
         static=along_axes_syms(top_k_axis), works_along=top_k_axis, linear=True,
         foldable=True)
register_reduction(prims.reduce_prod_p)
# the generic `lax.reduce` (a softmax's row max with a finite start): row by row, as the named
# reductions; finite for finite operands when its computation only picks (`lax.max`)
register(prims.reduce_p, masks=reduce_masks, align=reduce_alignment, static=aligned_syms,
         foldable=True, makes_nonfinite=True, finite_when=computation_selects,
         at_least_when=reduced_by_a_max)
register(prims.cumsum_p, masks=cumulative_masks, static=along_axes_syms(cumulative_axis),
         works_along=cumulative_axis,
         linear=True, foldable=True)
register(prims.cumprod_p, prims.cumlogsumexp_p,
         masks=cumulative_masks, static=along_axes_syms(cumulative_axis),
         works_along=cumulative_axis, foldable=True)
register(prims.dot_general_p, masks=contraction_masks, align=dot_general_alignment,
         static=contraction_syms, foldable=True, derivative_reads=BILINEAR,
         chooser=Chooser(by_original_contraction, contraction_applies))
# windows: a window sum (average pooling) and a convolution read their live windows' lanes
register(prims.reduce_window_sum_p, masks=windowed_masks(WINDOW_SUM),
         static=along_axes_syms(window_axes), works_along=window_axes,
         drops=window_drops(WINDOW_SUM), linear=True,
         foldable=True)
register(prims.conv_general_dilated_p, masks=windowed_masks(CONVOLUTION),
         align=convolution_alignment, static=aligned_lanes_syms,
         drops=window_drops(CONVOLUTION), foldable=True, derivative_reads=BILINEAR)
# an FFT transforms its trailing `fft_lengths` axes as one; the leading axes are a batch (no
# static rule: a mask the static pass cannot name is decided at run time, not taken as live as
# linear algebra's `batched_syms` takes it)
register(prims.fft_p, masks=batched_masks(_fft_core), align=batched_alignment(_fft_core),
         linear=True, foldable=True)

# --------------------------------------------------------------------------- linear algebra
# Matrix by matrix along the leading axes: a batch element is live where any lane of it is
# (`batched_masks(core)`: the first output's matrix axes). Their derivatives are singular at
# finite matrices (not positive definite, singular, repeated eigen- or singular values) where no
# one value per lane is safe: dropped batch elements are cut from differentiation. cholesky
# makes NaN, the solves inf, from finite operands.
for _p, _core, _facts in (
        (prims.cholesky_p, 2, dict(makes_nonfinite=True)),
        (prims.triangular_solve_p, 2, dict(makes_nonfinite=True)),
        (prims.tridiagonal_solve_p, 2, dict(makes_nonfinite=True)),
        (prims.lu_p, 2, {}),
        (prims.qr_p, 2, {}),
        (prims.eigh_p, 2, {}),
        (prims.svd_p, 1, {}),
        (prims.eig_p, 1, {})):
    register(_p, masks=batched_masks(_core), static=batched_syms(_core), cut_when_dropped=True,
             **_facts)
for _p in (prims.cholesky_p, prims.triangular_solve_p, prims.tridiagonal_solve_p):
    update(_p, align=batched_alignment(2))
register(prims.householder_product_p, masks=batched_masks(2), static=batched_syms(2),
         align=batched_alignment(2))
# `jnp.linalg.solve`, `inv`: a solve with the user's operator, singular where it is. Its operator
# is a program of its own (a batched one may mix batch elements): one whole, cut where every
# output lane is dropped (a Newton step under `jnp.where(done, x, x - solve(h, g))`).
register(prims.linear_solve_p, masks=solve_masks, static=solve_syms,
         cut_when_dropped=True, makes_nonfinite=True)

# --------------------------------------------------------------------------- bodies
register(prims.jit_p, prims.closed_call_p, masks=call_masks, kinds=call_kinds, static=call_syms,
         inline=True)
register(prims.remat_p, masks=opaque_call_masks, kinds=opaque_call_kinds, runs_bodies_once=True,
         nested_params=("jaxpr",), masked_body=RematBody(), body_inputs=direct_body_inputs,
         body_operands=direct_body_operands)
register(prims.custom_jvp_call_p, masks=custom_jvp_masks, kinds=custom_jvp_kinds,
         runs_bodies_once=True,
         carries=Carries(custom_jvp_static, custom_jvp_lanes, custom_jvp_held,
                         selects=custom_jvp_selects, masks_products=False),
         static=custom_jvp_syms,
         chooser=Chooser(rechoose, applies=confirms_selections, weighs=weighs_tangents,
                         guarded_results=False),
         cut_needless=writes_its_zeros,
         custom_rule=True, rule_program=derivative_program)
register(prims.custom_vjp_call_p, masks=custom_rule_masks, kinds=custom_rule_kinds,
         runs_bodies_once=True,
         static=custom_rule_syms,
         custom_rule=True, backward_param="bwd", forward_param="fwd_jaxpr_thunk",
         identity_param="out_trees", masked_body=SeededBackward())
register(prims.cond_p, masks=cond_masks, kinds=cond_kinds, nested_params=("branches",),
         case_body=branch_jaxpr,
         runs_bodies_once=True,
         masked_body=CondBody(), body_inputs=cond_body_inputs, body_operands=cond_body_operands)
register(prims.scan_p, masks=scan_masks, kinds=scan_kinds, static=scan_syms,
         loop_links=scan_loop_links,
         nested_params=("jaxpr",),
         masked_body=ScanBody(), steps=ScanSteps(),
         body_inputs=scan_body_inputs, body_operands=scan_body_operands)
register(prims.while_p, nested_params=("body_jaxpr",), body_inputs=while_body_inputs,
         loop_links=while_loop_links,
         body_operands=while_body_operands)
# collectives (in shard_map and pmap bodies): every lane live, as the other devices' lanes are
# not seen; the sums, gathers and permutations are linear
register(prims.psum_p, prims.all_gather_p, prims.all_to_all_p, prims.ppermute_p,
         *PRIVATE_LINEAR_COLLECTIVES, linear=True)
register(prims.pmax_p, *PRIVATE_OTHER_COLLECTIVES)
# `pvary`: each operand itself, typed as varying over a body's manual axes: lane to lane, and a
# constant cast so (a one-hot weight in a `shard_map` body) still carries no derivative and
# holds what it held (`MOVED`), so its zeros drop the lanes a contraction meets them at
register(*PRIVATE_VARY_CASTS, masks=paired_masks, static=paired_syms, linear=True, paired=True,
         carries=MOVED, bound=bounds.moved, range=ranges.same_range)
register(prims.axis_index_p)
# a shard_map body: rewritten on its own (its outputs and inputs live: liveness does not cross
# the per-device split yet), traced in shard_map's context (its mesh axes, varying types)
if shard_map_p is not None:
    register(shard_map_p, nested_params=("jaxpr",), body_inputs=direct_body_inputs,
             runs_bodies_once=True,
             body_operands=sliced_body_operands, body_context=shard_map_body_context)

# --------------------------------------------------------------------------- structural zeros
# How a backward program's lanes that hold 0 whatever cotangent it receives pass through
# (`_zero_lanes.py`); a product's zero factor and a quotient's zero numerator absorb.
for _p in (prims.add_p, prims.sub_p, prims.add_jaxvals_p):
    update(_p, zeros=Zeros(zero_lanes.every_operand))
for _p in (prims.neg_p, prims.convert_element_type_p, prims.copy_p, prims.name_p,
           prims.reduce_precision_p, prims.real_p, prims.imag_p, prims.conj_p, prims.square_p,
           prims.sharding_constraint_p):
    update(_p, zeros=Zeros(zero_lanes.like_operand(0)))
# no NaN from operands without NaN (`_taint.nan_free`: `jnp.where(isnan(x), inf, x)`'s cast)
for _p in (prims.neg_p, prims.convert_element_type_p, prims.copy_p, prims.reduce_precision_p,
           prims.stop_gradient_p, prims.abs_p):
    update(_p, keeps_nan_free=True)
update(prims.mul_p, zeros=Zeros(zero_lanes.any_operand, absorbs=frozenset({0, 1})))
update(prims.div_p, zeros=Zeros(zero_lanes.like_operand(0), absorbs=frozenset({0})))
update(prims.select_n_p, zeros=Zeros(zero_lanes.selected))
for _p in (prims.broadcast_in_dim_p, prims.reshape_p, prims.squeeze_p, prims.transpose_p,
           prims.rev_p, prims.slice_p, prims.dynamic_slice_p):
    update(_p, zeros=Zeros(zero_lanes.moved((0,))))
update(prims.pad_p, zeros=Zeros(zero_lanes.moved((0, 1))))
update(prims.dynamic_update_slice_p, zeros=Zeros(zero_lanes.moved((0, 1))))
update(prims.concatenate_p, zeros=Zeros(zero_lanes.moved()))
update(prims.reduce_sum_p, zeros=Zeros(zero_lanes.summed))
update(prims.scatter_add_p, zeros=Zeros(zero_lanes.scattered))

# operands whose inf or NaN makes the output inf or NaN (`_finite_lanes.py`): not `exp`,
# `x ** -1`, a divisor or `max`, which map an inf to a finite value


def _every_operand(eqn: JaxprEqn) -> frozenset[int]:
    return frozenset(range(len(eqn.invars)))


def _first_operand(eqn: JaxprEqn) -> frozenset[int]:
    return frozenset({0})


def _positive_power_base(eqn: JaxprEqn) -> frozenset[int]:
    return frozenset({0}) if eqn.params["y"] > 0 else frozenset()


for _p in (prims.add_p, prims.sub_p, prims.mul_p):
    update(_p, finite_where_finite=_every_operand)
for _p in (prims.neg_p, prims.abs_p, prims.sqrt_p, prims.cbrt_p, prims.log_p, prims.log1p_p,
           prims.square_p, prims.convert_element_type_p, prims.copy_p, prims.reduce_precision_p,
           prims.div_p, prims.reduce_sum_p, prims.reshape_p, prims.squeeze_p, prims.transpose_p,
           prims.broadcast_in_dim_p, prims.rev_p):
    update(_p, finite_where_finite=_first_operand)
update(prims.integer_pow_p, finite_where_finite=_positive_power_base)

# comparisons that bound an operand from below where they hold (`_by_hand.py`)
update(prims.gt_p, bounds_below=(True, 0))
update(prims.ge_p, bounds_below=(False, 0))
update(prims.lt_p, bounds_below=(True, 1))
update(prims.le_p, bounds_below=(False, 1))
