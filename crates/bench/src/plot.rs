//! PNG line charts for `airlock bench --plot DIR`, drawn with `plotters` on its bitmap backend.
//!
//! Text is rendered with `ab_glyph` from a TrueType file read at run time (no fontconfig, no
//! system libraries): `$AIRLOCK_PLOT_FONT`, else DejaVu Sans from Debian's
//! `fonts-dejavu-core`. Axes can be logarithmic: values are plotted as their log10 and the tick
//! labels map back, so one code path draws every chart.

use anyhow::{anyhow, bail, Context, Result};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Where the default font lives on Debian and Ubuntu (package `fonts-dejavu-core`).
pub const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Chart size for committed images: small, still readable.
pub const SIZE: (u32, u32) = (800, 500);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    Linear,
    Log,
}

#[derive(Clone, Debug)]
pub struct Axis {
    /// The axis title, with its unit.
    pub label: String,
    pub scale: Scale,
    /// Tick marks at the data's own x values (sweep points) instead of round numbers.
    pub ticks_at_data: bool,
}

impl Axis {
    pub fn new(label: &str, scale: Scale) -> Axis {
        Axis {
            label: label.to_string(),
            scale,
            ticks_at_data: false,
        }
    }

    pub fn at_data(mut self) -> Axis {
        self.ticks_at_data = true;
        self
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// A solid line with a dot at every point: a measurement.
    Measured,
    /// A dashed line, no dots: a reference (a physical limit, an estimate).
    Reference,
    /// A solid line, no dots: a dense time series.
    Trace,
}

#[derive(Clone, Debug)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub style: Style,
}

#[derive(Clone, Debug)]
pub struct Chart {
    pub title: String,
    pub x: Axis,
    pub y: Axis,
    pub series: Vec<Series>,
    /// Vertical dotted lines with a short label at the top (e.g. where a load level starts).
    pub markers: Vec<(f64, String)>,
    pub legend: Legend,
}

/// Where the legend box goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Legend {
    UpperLeft,
    MiddleLeft,
    MiddleRight,
    LowerRight,
}

impl Legend {
    pub(crate) fn position(self) -> SeriesLabelPosition {
        match self {
            Legend::UpperLeft => SeriesLabelPosition::UpperLeft,
            Legend::MiddleLeft => SeriesLabelPosition::MiddleLeft,
            Legend::MiddleRight => SeriesLabelPosition::MiddleRight,
            Legend::LowerRight => SeriesLabelPosition::LowerRight,
        }
    }
}

/// Registers the TTF font once per process: `$AIRLOCK_PLOT_FONT` or [`DEFAULT_FONT`].
pub fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let path = std::env::var_os("AIRLOCK_PLOT_FONT")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_FONT));
            let bytes = std::fs::read(&path).map_err(|error| {
                format!(
                    "--plot needs a TrueType font and {} cannot be read ({error}): install \
                     Debian's fonts-dejavu-core (apt-get install fonts-dejavu-core) or point \
                     AIRLOCK_PLOT_FONT at any .ttf file",
                    path.display()
                )
            })?;
            // plotters keeps a 'static reference; the font lives as long as the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).map_err(|_| {
                format!(
                    "{} is not a TrueType/OpenType font (set AIRLOCK_PLOT_FONT to a .ttf file)",
                    path.display()
                )
            })
        })
        .clone()
        .map_err(|message| anyhow!(message))
}

/// The colour of a series, the same for a target's name in every chart.
pub(crate) fn color_for(name: &str, index: usize) -> RGBColor {
    let fixed = [
        ("serve", RGBColor(31, 119, 180)),
        ("unified", RGBColor(44, 160, 44)),
        ("llama-cpp", RGBColor(214, 39, 40)),
        ("memcpy", RGBColor(80, 80, 80)),
        ("xxh3", RGBColor(148, 103, 189)),
        ("prefill", RGBColor(255, 127, 14)),
        ("decode", RGBColor(31, 119, 180)),
        ("pool size", RGBColor(80, 80, 80)),
    ];
    if let Some((_, color)) = fixed.iter().find(|(prefix, _)| name.starts_with(prefix)) {
        return *color;
    }
    const OTHERS: [RGBColor; 6] = [
        RGBColor(255, 127, 14),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(23, 190, 207),
        RGBColor(188, 189, 34),
        RGBColor(127, 127, 127),
    ];
    OTHERS[index % OTHERS.len()]
}

pub(crate) fn to_axis(scale: Scale, value: f64) -> f64 {
    match scale {
        Scale::Linear => value,
        Scale::Log => value.log10(),
    }
}

pub(crate) fn from_axis(scale: Scale, value: f64) -> f64 {
    match scale {
        Scale::Linear => value,
        Scale::Log => 10f64.powf(value),
    }
}

/// A compact tick label: integers as integers, others with three significant digits.
pub fn format_tick(value: f64) -> String {
    if value == 0.0 {
        return "0".into();
    }
    let rounded = value.round();
    if (value - rounded).abs() <= 1e-6 * value.abs().max(1.0) && value.abs() < 1e9 {
        return format!("{rounded:.0}");
    }
    let digits = (2 - value.abs().log10().floor() as i32).clamp(0, 6) as usize;
    let text = format!("{value:.digits$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

/// Axis range (in axis units) and tick positions (in axis units) for these data values.
pub fn axis_layout(axis: &Axis, values: &[f64]) -> (std::ops::Range<f64>, Vec<f64>) {
    let finite: Vec<f64> = values
        .iter()
        .copied()
        .filter(|v| v.is_finite() && (axis.scale == Scale::Linear || *v > 0.0))
        .collect();
    let (mut low, mut high) = finite
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    if !low.is_finite() {
        (low, high) = (1.0, 10.0);
    }
    match axis.scale {
        Scale::Linear => {
            if low >= 0.0 && !axis.ticks_at_data {
                low = 0.0;
            }
            if high <= low {
                high = low + 1.0;
            }
            let pad = if axis.ticks_at_data { 0.03 } else { 0.08 };
            let span = high - low;
            let range = (low - if low == 0.0 { 0.0 } else { pad * span })..(high + pad * span);
            let ticks = if axis.ticks_at_data {
                data_ticks(&finite, Scale::Linear)
            } else {
                nice_ticks(range.start, range.end)
            };
            (range, ticks)
        }
        Scale::Log => {
            if high <= low {
                (low, high) = (low / 2.0, high * 2.0);
            }
            let pad = (high / low).log10() * 0.05 + 0.02;
            let range = (low.log10() - pad)..(high.log10() + pad);
            let ticks = if axis.ticks_at_data {
                data_ticks(&finite, Scale::Log)
            } else {
                log_ticks(low, high)
            };
            (range, ticks.into_iter().map(f64::log10).collect())
        }
    }
}

/// The distinct data values, thinned to at most 12, none closer than 4% of the axis (in
/// `scale`'s units) to the one before, so labels never overlap.
pub(crate) fn data_ticks(values: &[f64], scale: Scale) -> Vec<f64> {
    let mut ticks = values.to_vec();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    let step = ticks.len().div_ceil(12).max(1);
    let ticks: Vec<f64> = ticks.into_iter().step_by(step).collect();
    let (Some(&first), Some(&last)) = (ticks.first(), ticks.last()) else {
        return ticks;
    };
    let min_gap = (to_axis(scale, last) - to_axis(scale, first)) * 0.04;
    let mut kept: Vec<f64> = Vec::new();
    for tick in ticks {
        match kept.last() {
            Some(&previous) if to_axis(scale, tick) - to_axis(scale, previous) < min_gap => {}
            _ => kept.push(tick),
        }
    }
    kept
}

/// Round ticks (1, 2 or 5 × 10^k apart) over [low, high], 4 to 10 of them.
pub(crate) fn nice_ticks(low: f64, high: f64) -> Vec<f64> {
    let raw = (high - low) / 6.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|step| *step >= raw)
        .unwrap_or(10.0 * magnitude);
    let first = (low / step).ceil() as i64;
    let last = (high / step).floor() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

/// 1, 2, 5 × 10^k within [low, high]; 1..9 × 10^k when the range is under a decade.
pub(crate) fn log_ticks(low: f64, high: f64) -> Vec<f64> {
    let decades = (low.log10().floor() as i32)..=(high.log10().ceil() as i32);
    let pick = |mantissas: &[f64]| -> Vec<f64> {
        decades
            .clone()
            .flat_map(|k| mantissas.iter().map(move |m| m * 10f64.powi(k)))
            .filter(|v| *v >= low * 0.999 && *v <= high * 1.001)
            .collect()
    };
    let ticks = pick(&[1.0, 2.0, 5.0]);
    if ticks.len() >= 3 {
        ticks
    } else {
        pick(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    }
}

/// A linear f64 axis (in axis units) whose tick marks are exactly `ticks`.
pub(crate) struct Ticked {
    pub(crate) range: std::ops::Range<f64>,
    pub(crate) ticks: Vec<f64>,
}

impl Ranged for Ticked {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let fraction = (value - self.range.start) / (self.range.end - self.range.start);
        let pixels = f64::from(limit.1 - limit.0);
        limit.0 + (pixels * fraction + 1e-3).floor() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.range.clone()
    }
}

/// Draws `chart` as a PNG of `size` pixels at `path`.
pub fn draw(chart: &Chart, path: &Path, size: (u32, u32)) -> Result<()> {
    register_font()?;
    if chart.series.iter().all(|s| s.points.is_empty()) {
        bail!("chart '{}' has no data", chart.title);
    }
    let xs: Vec<f64> = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .chain(chart.markers.iter().map(|m| m.0))
        .collect();
    let ys: Vec<f64> = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .collect();
    let (x_range, x_ticks) = axis_layout(&chart.x, &xs);
    let (y_range, y_ticks) = axis_layout(&chart.y, &ys);
    let (x_scale, y_scale) = (chart.x.scale, chart.y.scale);
    let plot_error = |error: &dyn std::fmt::Display| anyhow!("drawing {}: {error}", path.display());

    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_error(&e))?;
    let mut context = ChartBuilder::on(&root)
        .caption(&chart.title, ("sans-serif", 20))
        .margin(14)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(
            Ticked {
                range: x_range.clone(),
                ticks: x_ticks,
            },
            Ticked {
                range: y_range.clone(),
                ticks: y_ticks,
            },
        )
        .map_err(|e| plot_error(&e))?;
    context
        .configure_mesh()
        .x_desc(chart.x.label.as_str())
        .y_desc(chart.y.label.as_str())
        .x_label_formatter(&|v| format_tick(from_axis(x_scale, *v)))
        .y_label_formatter(&|v| format_tick(from_axis(y_scale, *v)))
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 15))
        .bold_line_style(RGBColor(225, 225, 225))
        .draw()
        .map_err(|e| plot_error(&e))?;

    // Labels closer than 7% of the width to the previous label are left out (lines stay).
    let mut last_label = f64::NEG_INFINITY;
    let min_gap = (x_range.end - x_range.start) * 0.07;
    for (x, label) in &chart.markers {
        let x = to_axis(x_scale, *x);
        let label = if x - last_label >= min_gap {
            last_label = x;
            label.clone()
        } else {
            String::new()
        };
        let line = [(x, y_range.start), (x, y_range.end)];
        context
            .draw_series(DashedLineSeries::new(
                line,
                3,
                4,
                RGBColor(170, 170, 170).into(),
            ))
            .map_err(|e| plot_error(&e))?;
        let top = y_range.end - (y_range.end - y_range.start) * 0.03;
        context
            .draw_series(std::iter::once(Text::new(
                label,
                (x, top),
                ("sans-serif", 12)
                    .into_font()
                    .color(&RGBColor(110, 110, 110)),
            )))
            .map_err(|e| plot_error(&e))?;
    }

    for (index, series) in chart.series.iter().enumerate() {
        let color = color_for(&series.name, index);
        let points: Vec<(f64, f64)> = series
            .points
            .iter()
            .filter(|(x, y)| {
                x.is_finite()
                    && y.is_finite()
                    && (x_scale == Scale::Linear || *x > 0.0)
                    && (y_scale == Scale::Linear || *y > 0.0)
            })
            .map(|&(x, y)| (to_axis(x_scale, x), to_axis(y_scale, y)))
            .collect();
        if points.is_empty() {
            continue;
        }
        let line_style = color.stroke_width(2);
        let annotation = match series.style {
            Style::Reference => {
                context.draw_series(DashedLineSeries::new(points.clone(), 8, 5, line_style))
            }
            Style::Measured | Style::Trace => {
                context.draw_series(LineSeries::new(points.clone(), line_style))
            }
        }
        .map_err(|e| plot_error(&e))?;
        annotation
            .label(series.name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        if series.style == Style::Measured {
            context
                .draw_series(
                    points
                        .iter()
                        .map(|&point| Circle::new(point, 3, color.filled())),
                )
                .map_err(|e| plot_error(&e))?;
        }
    }
    context
        .configure_series_labels()
        .position(chart.legend.position())
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(160, 160, 160))
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(|e| plot_error(&e))?;
    root.present()
        .map_err(|e| plot_error(&e))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_chart(x: Scale, y: Scale) -> Chart {
        Chart {
            title: "output tokens/s vs concurrency".into(),
            x: Axis::new("concurrency (requests in flight)", x).at_data(),
            y: Axis::new("output tokens/s", y),
            series: vec![
                Series {
                    name: "serve".into(),
                    points: vec![(1.0, 80.0), (2.0, 120.0), (4.0, 150.0), (8.0, 160.0)],
                    style: Style::Measured,
                },
                Series {
                    name: "llama-cpp".into(),
                    points: vec![(1.0, 40.0), (2.0, 41.0), (4.0, 42.0), (8.0, 43.0)],
                    style: Style::Measured,
                },
                Series {
                    name: "memcpy".into(),
                    points: vec![(1.0, 200.0), (8.0, 200.0)],
                    style: Style::Reference,
                },
            ],
            markers: vec![(2.0, "c=2".into())],
            legend: Legend::UpperLeft,
        }
    }

    #[test]
    fn charts_are_pngs_of_the_requested_size() {
        let dir = std::env::temp_dir().join(format!("airlock-plot-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cases = [
            ("linear.png", Scale::Log, Scale::Linear),
            ("loglog.png", Scale::Log, Scale::Log),
            ("lin.png", Scale::Linear, Scale::Linear),
        ];
        for (name, x, y) in cases {
            let path = dir.join(name);
            let mut chart = sample_chart(x, y);
            if x == Scale::Linear {
                chart.series[0].style = Style::Trace;
            }
            draw(&chart, &path, SIZE).unwrap();
            let decoder = png::Decoder::new(std::fs::File::open(&path).unwrap());
            let reader = decoder.read_info().unwrap();
            let info = reader.info();
            assert_eq!((info.width, info.height), SIZE, "{name}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_empty_chart_is_refused() {
        let mut chart = sample_chart(Scale::Log, Scale::Linear);
        for series in &mut chart.series {
            series.points.clear();
        }
        let path = std::env::temp_dir().join("airlock-never-written.png");
        assert!(draw(&chart, &path, SIZE).is_err());
    }

    #[test]
    fn ticks_are_round_numbers_or_the_data() {
        assert_eq!(nice_ticks(0.0, 172.0), vec![0.0, 50.0, 100.0, 150.0]);
        assert_eq!(
            log_ticks(3.0, 900.0),
            vec![5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0]
        );
        let axis = Axis::new("c", Scale::Log).at_data();
        let (_, ticks) = axis_layout(&axis, &[1.0, 2.0, 4.0, 2.0, 32.0]);
        let back: Vec<String> = ticks.iter().map(|t| format_tick(10f64.powf(*t))).collect();
        assert_eq!(back, ["1", "2", "4", "32"]);
        // 8175 beside 8192 on a log axis: one label, not two on top of each other.
        assert_eq!(
            data_ticks(&[128.0, 8175.0, 8192.0], Scale::Log),
            [128.0, 8175.0]
        );
        assert_eq!(format_tick(0.25), "0.25");
        assert_eq!(format_tick(0.5), "0.5");
        assert_eq!(format_tick(12.5), "12.5");
        assert_eq!(format_tick(8192.0), "8192");
    }
}
