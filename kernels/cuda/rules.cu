// gaps update rules on the GPU. Compiled at run time by NVRTC (see kernels/src/cuda.rs) with FMA
// contraction off, so every rule performs the operations of kernels/src/reference.rs in the same order.
// One grid-stride kernel; the rule is a uniform argument, so there is no divergence inside a warp.
// Rule ids follow gaps_kernels::Rule::ALL.

#define GA_BETA 0.999f
#define GA_EPS 1e-8f
#define DC_EPS 1e-7f
#define ADAM_BETA1 0.9f
#define ADAM_BETA2 0.999f
#define ADA_EPS 1e-8f
#define NADAM_BETA2 0.999f

enum {
    SGD = 0, MOMENTUM = 1, NESTEROV = 2, MULTI_MOMENTUM = 3, STALENESS_AWARE = 4, DC_ASGD = 5,
    DC_ASGD_ADAPTIVE = 6, GAP_AWARE = 7, DANA_ZERO = 8, DANA_SLIM = 9, DANA_DC = 10, DANA_GA = 11,
    ADAGRAD = 12, ADAM = 13, DELAY_NESTEROV = 14, NADAM = 15, GAP_ADAM = 16
};

struct Scalars {
    float lr, lr_max, gamma, wd, lambda, ms_decay, inv_staleness, ga_bias, adam_bias1, adam_bias2;
    float nag_gamma, nag_keep, nag_lr;
    float nadam_grad, nadam_mom, decay;
};

// One element of one rule's update: element i of every plane.
__device__ __forceinline__ void update_one(
    int rule, unsigned long long i,
    float* __restrict__ p, float* __restrict__ s0, float* __restrict__ s1, float* __restrict__ w0,
    const float* __restrict__ g, const float* __restrict__ r, const Scalars& k)
{
        const float pi = p[i];
        const float gi = g[i];
        switch (rule) {
        case SGD: { float d = gi + k.wd * pi; p[i] = pi - k.lr * d; break; }
        case DANA_SLIM: { p[i] = pi - k.lr * gi; break; }
        case MOMENTUM: case NESTEROV: case STALENESS_AWARE: {
            float d = gi + k.wd * pi;
            if (rule == STALENESS_AWARE) d = d * k.inv_staleness;
            float v = k.gamma * s0[i] + d;
            s0[i] = v;
            p[i] = rule == NESTEROV ? pi - k.lr * (d + k.gamma * v) : pi - k.lr * v;
            break;
        }
        case DELAY_NESTEROV: {
            float d = gi + k.wd * pi;
            float m = k.nag_gamma * s0[i] + k.nag_keep * d;
            s0[i] = m;
            p[i] = pi - k.nag_lr * m;
            break;
        }
        case MULTI_MOMENTUM: {
            float d = gi + k.wd * pi;
            float v = k.gamma * w0[i] + d;
            w0[i] = v;
            p[i] = pi - k.lr * v;
            break;
        }
        case DC_ASGD: case DC_ASGD_ADAPTIVE: {
            float lambda = k.lambda;
            if (rule == DC_ASGD_ADAPTIVE) {
                float ms = k.ms_decay * w0[i] + (1.0f - k.ms_decay) * gi * gi;
                w0[i] = ms;
                lambda = k.lambda / sqrtf(ms + DC_EPS);
            }
            float d = gi + lambda * gi * gi * (pi - r[i]) + k.wd * pi;
            float v = k.gamma * s0[i] + d;
            s0[i] = v;
            p[i] = pi - k.lr * v;
            break;
        }
        case GAP_AWARE: {
            float s = k.gamma > 0.0f ? s0[i] : gi;
            float ema = GA_BETA * s1[i] + (1.0f - GA_BETA) * s * s;
            s1[i] = ema;
            float c = k.lr_max * (sqrtf(ema * k.ga_bias) + GA_EPS);
            float penalty = 1.0f + fabsf(pi - r[i]) / c;
            float d = (gi + k.wd * pi) / penalty;
            float v = k.gamma * s0[i] + d;
            s0[i] = v;
            p[i] = pi - k.lr * v;
            break;
        }
        case DANA_ZERO: case DANA_DC: case DANA_GA: {
            float old = w0[i];
            float d;
            if (rule == DANA_DC) {
                d = gi + k.lambda * gi * gi * (pi - r[i]) + k.wd * pi;
            } else if (rule == DANA_GA) {
                float ema = GA_BETA * s1[i] + (1.0f - GA_BETA) * old * old;
                s1[i] = ema;
                float c = k.lr_max * (sqrtf(ema * k.ga_bias) + GA_EPS);
                float penalty = 1.0f + fabsf(pi - r[i]) / c;
                d = (gi + k.wd * pi) / penalty;
            } else {
                d = gi + k.wd * pi;
            }
            float nv = k.gamma * old + d;
            s0[i] += nv - old;
            w0[i] = nv;
            p[i] = pi - k.lr * nv;
            break;
        }
        case ADAGRAD: {
            float d = gi + k.wd * pi;
            float acc = s0[i] + d * d;
            s0[i] = acc;
            p[i] = pi - k.lr * d / (sqrtf(acc) + ADA_EPS);
            break;
        }
        case ADAM: {
            float d = gi + k.wd * pi;
            float m = ADAM_BETA1 * s0[i] + (1.0f - ADAM_BETA1) * d;
            float v = ADAM_BETA2 * s1[i] + (1.0f - ADAM_BETA2) * d * d;
            s0[i] = m;
            s1[i] = v;
            p[i] = pi - k.lr * (m * k.adam_bias1) / (sqrtf(v * k.adam_bias2) + ADA_EPS);
            break;
        }
        case NADAM: {
            float m = k.gamma * s0[i] + (1.0f - k.gamma) * gi;
            float v = NADAM_BETA2 * s1[i] + (1.0f - NADAM_BETA2) * gi * gi;
            s0[i] = m;
            s1[i] = v;
            float denom = sqrtf(v * k.adam_bias2) + ADA_EPS;
            p[i] = pi * k.decay - k.nadam_grad * gi / denom - k.nadam_mom * m / denom;
            break;
        }
        case GAP_ADAM: {
            float d = gi + k.wd * pi;
            float v = ADAM_BETA2 * s1[i] + (1.0f - ADAM_BETA2) * d * d;
            s1[i] = v;
            float base = 1.0f + fabsf(pi - r[i]) / k.lr_max;
            float penalty = base * sqrtf(base);
            float m = k.gamma * s0[i] + (1.0f - k.gamma) * (d / penalty);
            s0[i] = m;
            p[i] = pi - k.lr * m / (sqrtf(v * k.adam_bias2) + ADA_EPS);
            break;
        }
        default: break;
        }
}

// One block of `n` elements with its planes in separate buffers (the host-resident path).
extern "C" __global__ void gaps_update(
    int rule, unsigned long long n,
    float* __restrict__ p, float* __restrict__ s0, float* __restrict__ s1, float* __restrict__ w0,
    const float* __restrict__ g, const float* __restrict__ r, const Scalars k)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        update_one(rule, i, p, s0, s1, w0, g, r, k);
    }
}

// One entry of a push's chunk table (layout of gaps_kernels::plan::TableEntry): where a chunk's parameters
// and shared planes sit in the arenas (the same offset in each), where the pushing worker's plane for it
// sits, where its gradient and read echo sit in the staged push, its length, its rule and its scalars.
struct TableEntry {
    unsigned long long param_offset, worker_offset, grad_offset, read_offset;
    unsigned int len;
    int rule;
    Scalars k;
};
// The host writes these with gaps_kernels::cuda::DeviceEntry (#[repr(C)], 104 bytes); keep the two in step.
static_assert(sizeof(TableEntry) == 104, "TableEntry must match gaps_kernels::cuda::DeviceEntry");


// Every chunk of one push in one launch: blockIdx.y picks the table entry, x strides over its elements.
// The state never leaves the device; only the staged gradient (and echo) came in.
extern "C" __global__ void gaps_update_table(
    const TableEntry* __restrict__ table, unsigned int first_entry,
    float* __restrict__ p, float* __restrict__ s0, float* __restrict__ s1, float* __restrict__ w,
    const float* __restrict__ staged)
{
    const TableEntry e = table[first_entry + blockIdx.y];
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < e.len; i += stride) {
        update_one(e.rule, i, p + e.param_offset, s0 + e.param_offset, s1 + e.param_offset, w + e.worker_offset,
                   staged + e.grad_offset, staged + e.read_offset, e.k);
    }
}
