/// Which implementation of the hot kernels to run, chosen once from the CPU's features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Portable Rust, no target features: the reference the SIMD paths are tested against.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// AVX2 plus AVX-512 (F, BW, VL, VNNI): the quantized matmuls of batches use
    /// `vpdpbusd` and keep each row's sum in its own lane, so no reduction tree is needed; every
    /// other kernel is the AVX2 one. Computes bit for bit what `Avx2` computes.
    Avx512Vnni,
    /// llama.cpp's own arithmetic, lane for lane (see `ggml_exact`): logits equal to a
    /// llama.cpp AVX-512 build's, bit for bit, on any CPU. Slow; for checking against it.
    GgmlExact,
    /// As `GgmlExact`, for a llama.cpp build for AVX2 without AVX-512 (8-lane attention sums,
    /// its own `ggml_v_expf`).
    GgmlExactAvx2,
}

impl Backend {
    /// The fastest backend this CPU supports.
    pub fn detect() -> Backend {
        if has_avx512_vnni() {
            Backend::Avx512Vnni
        } else if has_avx2() {
            Backend::Avx2
        } else {
            Backend::Scalar
        }
    }

    /// Every backend this CPU can run that computes what `Scalar` computes, for tests that
    /// compare them (`GgmlExact` follows llama.cpp's order instead).
    pub fn available() -> Vec<Backend> {
        let mut backends = vec![Backend::Scalar];
        if has_avx2() {
            backends.push(Backend::Avx2);
        }
        if has_avx512_vnni() {
            backends.push(Backend::Avx512Vnni);
        }
        backends
    }

    /// Whether `self` runs the AVX2 element-wise kernels here (a fast backend, on a CPU that
    /// has AVX2, FMA and F16C).
    pub(crate) fn uses_avx2(self) -> bool {
        matches!(self, Backend::Avx2 | Backend::Avx512Vnni) && has_avx2()
    }

    /// Whether this CPU can run `self` (`GgmlExact` is portable Rust, like `Scalar`).
    pub fn is_supported(self) -> bool {
        self.ggml_build().is_some() || Backend::available().contains(&self)
    }

    /// The llama.cpp build a `ggml-exact` backend reproduces; `None` for the fast ones.
    pub fn ggml_build(self) -> Option<crate::ggml_exact::Build> {
        match self {
            Backend::GgmlExact => Some(crate::ggml_exact::Build::Avx512),
            Backend::GgmlExactAvx2 => Some(crate::ggml_exact::Build::Avx2),
            Backend::Scalar | Backend::Avx2 | Backend::Avx512Vnni => None,
        }
    }

    /// Parses a backend's name: `name()`, or `scalar` / `avx2` / `avx512-vnni` / `ggml-exact`
    /// / `ggml-exact-avx2`.
    pub fn from_name(name: &str) -> Option<Backend> {
        [
            Backend::Scalar,
            Backend::Avx2,
            Backend::Avx512Vnni,
            Backend::GgmlExact,
            Backend::GgmlExactAvx2,
        ]
        .into_iter()
        .find(|b| b.name() == name || b.short_name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Scalar => "scalar",
            Backend::Avx2 => "avx2+fma+f16c",
            Backend::Avx512Vnni => "avx512-vnni+avx2",
            Backend::GgmlExact => "ggml-exact",
            Backend::GgmlExactAvx2 => "ggml-exact-avx2",
        }
    }

    fn short_name(self) -> &'static str {
        match self {
            Backend::Scalar => "scalar",
            Backend::Avx2 => "avx2",
            Backend::Avx512Vnni => "avx512-vnni",
            Backend::GgmlExact => "ggml-exact",
            Backend::GgmlExactAvx2 => "ggml-exact-avx2",
        }
    }
}

/// AVX2, FMA and F16C: what every SIMD kernel here needs (std caches the answer).
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `has_avx2` plus what the VNNI matmuls use: `vpdpbusd` and byte ops on 512-bit registers.
pub(crate) fn has_avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx2()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
