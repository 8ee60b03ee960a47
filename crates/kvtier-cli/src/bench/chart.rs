//! The benchmark chart: a PNG drawn with plotters' bitmap backend and an embedded font.
//!
//! Invariant: rendering needs nothing from the system (no fontconfig, no font files): text uses the
//! DejaVu Sans bytes compiled into the binary through plotters' `ab_glyph` backend.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;

use crate::bench::report::Summary;

/// Errors drawing the chart.
#[derive(Debug, thiserror::Error)]
#[error("drawing chart: {0}")]
pub struct ChartError(String);

fn err<E: std::fmt::Display>(e: E) -> ChartError {
    ChartError(e.to_string())
}

static FONT: Once = Once::new();

fn register_font() {
    FONT.call_once(|| {
        if plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .is_err()
        {
            tracing::warn!("embedded font rejected; chart text may be missing");
        }
    });
}

const COLORS: [RGBColor; 6] = [
    RGBColor(0x8c, 0x8c, 0x8c),
    RGBColor(0x4c, 0x72, 0xb0),
    RGBColor(0x55, 0xa8, 0x68),
    RGBColor(0xdd, 0x84, 0x52),
    RGBColor(0xc4, 0x4e, 0x52),
    RGBColor(0x81, 0x72, 0xb3),
];

/// Draws TTFT p50 per configuration and workload (bars, with p90 whiskers as text), and the chat
/// workload's TTFT p50 per round (lines), into `path`.
pub fn draw(
    path: &Path,
    rows: &[Summary],
    configs: &[String],
    title: &str,
) -> Result<(), ChartError> {
    register_font();
    let root = BitMapBackend::new(path, (1280, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 22)).map_err(err)?;
    let (left, right) = root.split_horizontally(680);

    // Left: grouped bars of TTFT p50.
    let workloads: Vec<String> = {
        let mut w: Vec<String> = Vec::new();
        for r in rows {
            if !w.contains(&r.workload) {
                w.push(r.workload.clone());
            }
        }
        w
    };
    // Head room above the tallest bar for the legend.
    let ymax = rows.iter().map(|r| r.ttft_p50_ms).fold(1.0_f64, f64::max)
        * (1.25 + 0.06 * configs.len() as f64);
    let n = configs.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&left)
        .caption("TTFT p50 (ms) by configuration", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(34)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..workloads.len().max(1) as f64, 0.0..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .light_line_style(WHITE)
        .y_desc("ms")
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(err)?;
    for (wi, w) in workloads.iter().enumerate() {
        let x0 = wi as f64 + 0.1;
        let width = 0.8 / n;
        for (ci, c) in configs.iter().enumerate() {
            let Some(r) = rows.iter().find(|r| &r.workload == w && &r.config == c) else {
                continue;
            };
            let color = COLORS[ci % COLORS.len()];
            let xa = x0 + ci as f64 * width;
            let xb = xa + width * 0.9;
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(xa, 0.0), (xb, r.ttft_p50_ms)],
                    color.filled(),
                )))
                .map_err(err)?;
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("{:.0}", r.ttft_p50_ms),
                    (xa, r.ttft_p50_ms + ymax * 0.01),
                    ("sans-serif", 12),
                )))
                .map_err(err)?;
        }
        chart
            .draw_series(std::iter::once(Text::new(
                w.clone(),
                (wi as f64 + 0.42, -ymax * 0.035),
                ("sans-serif", 15),
            )))
            .map_err(err)?;
    }
    for (ci, c) in configs.iter().enumerate() {
        let color = COLORS[ci % COLORS.len()];
        let y = ymax * (0.97 - 0.06 * ci as f64);
        let x = workloads.len().max(1) as f64 * 0.62;
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [
                    (x, y),
                    (x + 0.04 * workloads.len().max(1) as f64, y - ymax * 0.035),
                ],
                color.filled(),
            )))
            .map_err(err)?;
        chart
            .draw_series(std::iter::once(Text::new(
                c.clone(),
                (x + 0.06 * workloads.len().max(1) as f64, y),
                ("sans-serif", 14),
            )))
            .map_err(err)?;
    }

    // Right: TTFT p50 per turn for the first workload that has turns (chat).
    let first = workloads.first().cloned().unwrap_or_default();
    let turn_rows: Vec<&Summary> = rows.iter().filter(|r| r.workload == first).collect();
    let turns = turn_rows
        .iter()
        .map(|r| r.ttft_p50_ms_by_turn.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let tmax = turn_rows
        .iter()
        .flat_map(|r| r.ttft_p50_ms_by_turn.iter().copied())
        .fold(1.0_f64, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&right)
        .caption(
            format!("{first}: TTFT p50 (ms) per round"),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(34)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..(turns as f64 - 1.0).max(1.0), 0.0..tmax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("round")
        .x_labels(turns.min(12))
        .x_label_formatter(&|x| format!("{}", x.round() as i64 + 1))
        .light_line_style(WHITE)
        .y_desc("ms")
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(err)?;
    for (ci, c) in configs.iter().enumerate() {
        let Some(r) = turn_rows.iter().find(|r| &r.config == c) else {
            continue;
        };
        let color = COLORS[ci % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                r.ttft_p50_ms_by_turn
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| (i as f64, v)),
                color.stroke_width(3),
            ))
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::TierCounts;
    use crate::bench::report::HitRates;

    fn row(w: &str, c: &str, p50: f64) -> Summary {
        Summary {
            workload: w.into(),
            config: c.into(),
            requests: 1,
            errors: 0,
            wall_s: 1.0,
            ttft_p50_ms: p50,
            ttft_p90_ms: p50,
            ttft_p99_ms: p50,
            e2e_p50_ms: p50,
            requests_per_s: 1.0,
            output_tokens_per_s: 1.0,
            prompt_tokens: 1,
            computed_prompt_tokens: 1,
            recomputed_tokens: 0,
            hit_rate: HitRates::default(),
            offloaded_blocks: TierCounts::default(),
            onboarded_blocks: TierCounts::default(),
            ttft_p50_ms_by_turn: vec![p50, p50 * 2.0, p50 * 3.0],
        }
    }

    #[test]
    fn draws_a_png_without_system_fonts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.png");
        let rows = vec![
            row("chat", "a", 10.0),
            row("chat", "b", 3.0),
            row("docqa", "a", 20.0),
            row("docqa", "b", 4.0),
        ];
        draw(&path, &rows, &["a".into(), "b".into()], "test").unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(bytes.len() > 5000);
    }
}
