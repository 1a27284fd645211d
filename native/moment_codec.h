// Adam's moments in 8 bits: block-scaled codes (offload_optimizer.state_dtype int8).
//
// Note [8-bit moments]
// A sub-group's moments are cut into blocks of kQuantBlock elements (the last
// may be shorter). Each block keeps one fp32 scale, its largest magnitude, and
// one byte per element: a small float relative to that scale, so the precision
// is relative (as in 8-bit Adam's dynamic quantization) rather than a fixed step:
//
//   exp_avg:        sign bit + 7 bits, 3 of mantissa: 127 magnitudes from
//                   1.25 * 2^-16 to 1 of the scale, relative error <= 1/16;
//                   smaller magnitudes become 0 (a smaller step, never a larger one).
//   exp_avg_sq:     stored as its square root s (so 16 octaves of s cover 32 of v),
//                   8 bits, 4 of mantissa: 255 values from 1.125 * 2^-16 to 1 of
//                   the scale, relative error <= 1/32; a positive s below the
//                   smallest becomes the smallest, never 0, because s divides
//                   the step: rounding it up makes the step smaller, to 0 unbounded.
//
// Code c > 0 stands for the float whose bits are (c + base) << (23 - mantissa
// bits), base putting the top code at 1.0; code 0 is 0. Encoding x with scale
// S: r = |x| * (1 / S) in fp32 (0 when S < FLT_MIN or is NaN), its bits with
// the sign cleared rounded to nearest even at the code's mantissa width, then
// clamped to the code range (NaN to the top code). A block holding a NaN has
// scale NaN, so NaN reaches every element of the block, as it would the weights.
//
// Decoding is scale * value(c) (negated for a set sign bit) and v = s * s, one
// correctly rounded fp32 operation each; offload/optim/moment_codec.py does
// the same in PyTorch, bit for bit. Adam runs on the decoded block in fp32
// (Note [bit-identical Adam]); the new weights use the new fp32 moments, which
// are encoded only when stored. Decoding a block and encoding it again gives
// back its bytes (sqrt(s * s) == s in binary floating point), so checkpoints
// that hold moments in fp32 resume bitwise.
#pragma once

#include <cstdint>

namespace offload_native {

constexpr int64_t kQuantBlock = 2048;

// Decode one block of `len` elements into fp32 exp_avg and exp_avg_sq.
void decode_moments(const uint8_t* m_codes, float m_scale, const uint8_t* s_codes, float s_scale, int64_t len,
                    float* exp_avg, float* exp_avg_sq);

// Encode one block; exp_avg_sq is overwritten with its square root on the way.
void encode_moments(const float* exp_avg, float* exp_avg_sq, int64_t len, uint8_t* m_codes, float* m_scale,
                    uint8_t* s_codes, float* s_scale);

}  // namespace offload_native
