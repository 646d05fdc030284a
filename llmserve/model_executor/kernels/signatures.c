/* The kinds of the functions native.py calls, for it to compare with its ctypes declarations (signatures.py)
 * at load: a declaration that differs from the prototype would pass the wrong bytes, or read a return
 * value that is not there, without any error. Each SIGNATURE line names a function's return and parameter
 * types once: a static assertion checks them against the prototype, so that a prototype changed without
 * its line fails to compile, and the kinds exported are computed from those same types. */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* A type's kind as signatures.py spells a ctypes type: i32 (int), i64, f32, char* for a string, the struct
 * pointed to with a star, p for any other pointer, void. A type not listed fails to compile. */
#define KIND(type)                                                                                              \
    _Generic((type *)0, void *: "void", int *: "i32", int64_t *: "i64", float *: "f32", char **: "char*",      \
             const char **: "char*", const Weight **: "Weight*", const DecoderSpec **: "DecoderSpec*",         \
             void **: "p", const void **: "p", float **: "p", const float **: "p", int64_t **: "p",            \
             const int64_t **: "p", const uint8_t **: "p")

/* KINDS(a, b, ...): KIND(a), KIND(b), ..., for up to 20 types. */
#define KINDS(...)                                                                                               \
    PICK(__VA_ARGS__, K20, K19, K18, K17, K16, K15, K14, K13, K12, K11, K10, K9, K8, K7, K6, K5, K4, K3, K2, K1, \
         _)(__VA_ARGS__)
#define PICK(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, _17, _18, _19, _20, macro, ...) \
    macro
#define K1(t) KIND(t)
#define K2(t, ...) KIND(t), K1(__VA_ARGS__)
#define K3(t, ...) KIND(t), K2(__VA_ARGS__)
#define K4(t, ...) KIND(t), K3(__VA_ARGS__)
#define K5(t, ...) KIND(t), K4(__VA_ARGS__)
#define K6(t, ...) KIND(t), K5(__VA_ARGS__)
#define K7(t, ...) KIND(t), K6(__VA_ARGS__)
#define K8(t, ...) KIND(t), K7(__VA_ARGS__)
#define K9(t, ...) KIND(t), K8(__VA_ARGS__)
#define K10(t, ...) KIND(t), K9(__VA_ARGS__)
#define K11(t, ...) KIND(t), K10(__VA_ARGS__)
#define K12(t, ...) KIND(t), K11(__VA_ARGS__)
#define K13(t, ...) KIND(t), K12(__VA_ARGS__)
#define K14(t, ...) KIND(t), K13(__VA_ARGS__)
#define K15(t, ...) KIND(t), K14(__VA_ARGS__)
#define K16(t, ...) KIND(t), K15(__VA_ARGS__)
#define K17(t, ...) KIND(t), K16(__VA_ARGS__)
#define K18(t, ...) KIND(t), K17(__VA_ARGS__)
#define K19(t, ...) KIND(t), K18(__VA_ARGS__)
#define K20(t, ...) KIND(t), K19(__VA_ARGS__)

/* Appends `text` to buffer [size] where it fits; returns the length with it. */
static int64_t append(char *buffer, int64_t size, int64_t used, const char *text)
{
    const int64_t n = (int64_t)strlen(text);
    if (used + n < size) {
        memcpy(buffer + used, text, (size_t)n);
        buffer[used + n] = '\0';
    }
    return used + n;
}

/* Appends the line "name: ret(kind, kind, ...)"; a function without parameters has the one kind void. */
static int64_t append_signature(char *buffer, int64_t size, int64_t used, const char *name, const char *ret,
                                const char *const *kinds, int64_t n)
{
    used = append(buffer, size, append(buffer, size, append(buffer, size, used, name), ": "), ret);
    used = append(buffer, size, used, "(");
    for (int64_t i = 0; i < n; i++)
        used = append(buffer, size, append(buffer, size, used, i ? ", " : ""), kinds[i]);
    return append(buffer, size, used, ")\n");
}

#define SIGNATURE(ret, function, ...)                                                                      \
    do {                                                                                                  \
        _Static_assert(__builtin_types_compatible_p(__typeof__(&function), ret (*)(__VA_ARGS__)),         \
                       #function "'s prototype differs from its SIGNATURE: update it and signatures.py"); \
        const char *const kinds[] = {KINDS(__VA_ARGS__)};                                                 \
        used = append_signature(buffer, size, used, #function, KIND(ret), kinds,                          \
                                (int64_t)(sizeof kinds / sizeof *kinds));                                \
    } while (0)

/* Writes "name: kinds" lines of every function native.py calls into buffer [size] where they fit, with a
 * terminating NUL; returns their length (a size no greater than it is too small). */
int64_t kernel_signatures(char *buffer, int64_t size)
{
    int64_t used = 0;
    if (size > 0)
        buffer[0] = '\0';
    SIGNATURE(const char *, kernels_isa, void);
    SIGNATURE(int64_t, struct_layout, const char *);
    SIGNATURE(int64_t, kernel_signatures, char *, int64_t);
    SIGNATURE(int64_t, row_bytes, int, int64_t);
    SIGNATURE(int, is_block_type, int);
    SIGNATURE(void, round_rows, const float *, int64_t, int64_t, float *);
    SIGNATURE(int, int8_gemm_available, void);
    SIGNATURE(int, dequantize_rows, const uint8_t *, int, int64_t, int64_t, const int64_t *, int64_t, float *, int);
    SIGNATURE(int, weight_gemm, const float *, int64_t, int64_t, const Weight *, float *, int);
    SIGNATURE(int, block_gemv, const float *, int64_t, int64_t, const Weight *, int64_t, float *, int);
    SIGNATURE(int, int8_gemm, const float *, int64_t, int64_t, const Weight *, int64_t, float *, int);
    SIGNATURE(int, paged_decode_attention, const float *, const void *, const void *, const int64_t *,
              const int64_t *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
              int64_t, float, int);
    SIGNATURE(int, prefill_attention, const float *, const void *, const void *, const int64_t *, int64_t, int64_t,
              int64_t, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int);
    SIGNATURE(int, decoder_step, const DecoderSpec *, float *, const int64_t *, const int64_t *, const int64_t *,
              const int64_t *, int64_t, int64_t, float *, int);
    SIGNATURE(void, argmax_rows, const float *, int64_t, int64_t, int64_t *, int);
    SIGNATURE(void, gated_activation, const float *, int64_t, int64_t, int64_t, float *, int);
    return used;
}
