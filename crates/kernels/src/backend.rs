/// Which implementation of the hot kernels to run, chosen once from the CPU's features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Portable Rust, no target features: the reference the SIMD paths are tested against.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
}

impl Backend {
    /// The fastest backend this CPU supports.
    pub fn detect() -> Backend {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                return Backend::Avx2;
            }
        }
        Backend::Scalar
    }

    /// Every backend this CPU can run, for tests that compare them.
    pub fn available() -> Vec<Backend> {
        let mut backends = vec![Backend::Scalar];
        if Backend::detect() == Backend::Avx2 {
            backends.push(Backend::Avx2);
        }
        backends
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Scalar => "scalar",
            Backend::Avx2 => "avx2+fma+f16c",
        }
    }
}
