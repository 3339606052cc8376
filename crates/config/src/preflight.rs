//! `airlock preflight`: checks a deployment before it runs (from a TOML file) or while it runs
//! (from the router's `/health`), node by node: weights, KV memory, pool capacity in tokens,
//! context length, headroom (capacity / context), verdict.
//!
//! ```toml
//! [router]
//! context_length = 8192            # optional: the router's limit
//!
//! [[node]]
//! name = "prefill-a"
//! role = "prefill"                 # prefill | decode | unified
//! host = "10.0.0.1:9001"           # optional, shown in the table
//! kv_memory = "256MiB"             # or kv_tokens = 8192, or kv_memory_fraction = 0.5
//! memory = "8GiB"                  # the host's memory, with kv_memory_fraction
//! context_length = 8192            # or "auto"; default: the model's
//! page_size = 16
//! ```

use crate::sizing::{
    parse_bytes, plan_pool, resolve_context, ContextSetting, KvBudget, ModelShape,
};
use serde::Deserialize;
use std::fmt::Write;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Deployment {
    pub router: Option<RouterSpec>,
    #[serde(rename = "node", default)]
    pub nodes: Vec<NodeSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterSpec {
    pub context_length: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    pub name: String,
    pub role: String,
    pub host: Option<String>,
    pub kv_tokens: Option<u64>,
    pub kv_memory: Option<String>,
    pub kv_memory_fraction: Option<f64>,
    pub memory: Option<String>,
    pub context_length: Option<toml::Value>,
    pub page_size: Option<u64>,
}

/// One row of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeReport {
    pub name: String,
    pub role: String,
    pub weight_bytes: Option<u64>,
    pub kv_bytes: Option<u64>,
    pub capacity_tokens: Option<u64>,
    pub context_length: Option<u64>,
    pub page_size: Option<u64>,
    /// `Ok` or the reasons it fails.
    pub problems: Vec<String>,
}

/// What a live worker reports in `/health`.
#[derive(Clone, Debug, PartialEq)]
pub struct LiveNode {
    pub name: String,
    pub role: String,
    pub up: bool,
    pub weight_bytes: Option<u64>,
    pub kv_bytes: Option<u64>,
    pub capacity_tokens: Option<u64>,
    pub context_length: Option<u64>,
    pub page_size: Option<u64>,
}

impl NodeReport {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }

    fn headroom(&self) -> Option<f64> {
        Some(self.capacity_tokens? as f64 / self.context_length? as f64)
    }
}

pub fn parse(text: &str) -> Result<Deployment, String> {
    let deployment: Deployment = toml::from_str(text).map_err(|e| e.message().to_string())?;
    if deployment.nodes.is_empty() {
        return Err("no [[node]] entries".into());
    }
    Ok(deployment)
}

/// Checks every node of a planned deployment serving a model of `shape` with `weight_bytes`
/// of weights, plus the cross-node rules: prefill and decode share a page size, and the
/// router's context fits every worker's.
pub fn evaluate(deployment: &Deployment, shape: &ModelShape, weight_bytes: u64) -> Vec<NodeReport> {
    let mut reports: Vec<NodeReport> = deployment
        .nodes
        .iter()
        .map(|node| evaluate_node(node, shape, weight_bytes))
        .collect();
    let router_context = deployment.router.as_ref().and_then(|r| r.context_length);
    cross_checks(&mut reports, router_context);
    reports
}

/// The same checks over what running workers report.
pub fn evaluate_live(nodes: &[LiveNode], router_context: Option<u64>) -> Vec<NodeReport> {
    let mut reports: Vec<NodeReport> = nodes
        .iter()
        .map(|node| {
            let mut problems = Vec::new();
            if !node.up {
                problems.push("not linked to the router".to_string());
            }
            if let (Some(capacity), Some(context)) = (node.capacity_tokens, node.context_length) {
                if capacity < context {
                    problems.push(format!(
                        "pool holds {capacity} tokens, under its context length {context}"
                    ));
                }
            }
            NodeReport {
                name: node.name.clone(),
                role: node.role.clone(),
                weight_bytes: node.weight_bytes,
                kv_bytes: node.kv_bytes,
                capacity_tokens: node.capacity_tokens,
                context_length: node.context_length,
                page_size: node.page_size,
                problems,
            }
        })
        .collect();
    cross_checks(&mut reports, router_context);
    reports
}

fn evaluate_node(node: &NodeSpec, shape: &ModelShape, weight_bytes: u64) -> NodeReport {
    let mut report = NodeReport {
        name: node.name.clone(),
        role: node.role.clone(),
        weight_bytes: Some(weight_bytes),
        kv_bytes: None,
        capacity_tokens: None,
        context_length: None,
        page_size: node.page_size.or(Some(16)),
        problems: Vec::new(),
    };
    if !matches!(node.role.as_str(), "prefill" | "decode" | "unified") {
        report.problems.push(format!(
            "role '{}' is not prefill, decode or unified",
            node.role
        ));
        return report;
    }
    let budget = match budget(node, weight_bytes) {
        Ok(budget) => budget,
        Err(problem) => {
            report.problems.push(problem);
            return report;
        }
    };
    let page_size = report.page_size.unwrap_or(16);
    let plan = match plan_pool(shape, page_size, budget) {
        Ok(plan) => plan,
        Err(error) => {
            report.problems.push(error.to_string());
            return report;
        }
    };
    report.kv_bytes = Some(plan.kv_bytes);
    report.capacity_tokens = Some(plan.capacity_tokens);
    let setting = match &node.context_length {
        None => ContextSetting::Tokens(shape.context_length_max),
        Some(toml::Value::String(text)) if text == "auto" => ContextSetting::Auto,
        Some(toml::Value::Integer(n)) if *n > 0 => ContextSetting::Tokens(*n as u64),
        Some(other) => {
            report.problems.push(format!(
                "context_length {other} is not a positive number or \"auto\""
            ));
            return report;
        }
    };
    match resolve_context(&plan, shape, setting) {
        Ok(context) => report.context_length = Some(context),
        Err(error) => {
            report.context_length = Some(error.context_length);
            report.problems.push(format!(
                "pool holds {} tokens, under its context length {}",
                error.capacity_tokens, error.context_length
            ));
        }
    }
    if let Some(context) = report.context_length {
        if context > shape.context_length_max {
            report.problems.push(format!(
                "context length {context} is over the model's {}",
                shape.context_length_max
            ));
        }
    }
    report
}

fn budget(node: &NodeSpec, weight_bytes: u64) -> Result<KvBudget, String> {
    let given = [
        node.kv_tokens.is_some(),
        node.kv_memory.is_some(),
        node.kv_memory_fraction.is_some(),
    ];
    if given.iter().filter(|&&g| g).count() != 1 {
        return Err("give exactly one of kv_tokens, kv_memory, kv_memory_fraction".into());
    }
    if let Some(tokens) = node.kv_tokens {
        return Ok(KvBudget::Tokens(tokens));
    }
    if let Some(memory) = &node.kv_memory {
        return Ok(KvBudget::Bytes(parse_bytes(memory)?));
    }
    let fraction = node.kv_memory_fraction.unwrap_or_default();
    let memory = node
        .memory
        .as_deref()
        .ok_or("kv_memory_fraction needs the host's memory (memory = \"8GiB\")")?;
    Ok(KvBudget::Fraction {
        fraction,
        available_bytes: parse_bytes(memory)?,
        weight_bytes,
        working_bytes: crate::sizing::WORKING_BYTES,
    })
}

fn cross_checks(reports: &mut [NodeReport], router_context: Option<u64>) {
    let transfer_page_sizes: Vec<u64> = reports
        .iter()
        .filter(|r| r.role == "prefill" || r.role == "decode")
        .filter_map(|r| r.page_size)
        .collect();
    let mismatch = transfer_page_sizes.windows(2).any(|w| w[0] != w[1]);
    let has_prefill = reports.iter().any(|r| r.role == "prefill");
    let has_decode = reports.iter().any(|r| r.role == "decode");
    for report in reports.iter_mut() {
        let transfers = report.role == "prefill" || report.role == "decode";
        if transfers && mismatch {
            report
                .problems
                .push("prefill and decode page sizes differ".into());
        }
        if report.role == "prefill" && !has_decode {
            report.problems.push("no decode node to send to".into());
        }
        if report.role == "decode" && !has_prefill {
            report
                .problems
                .push("no prefill node to receive from".into());
        }
        if let (Some(router), Some(context)) = (router_context, report.context_length) {
            if router > context {
                report.problems.push(format!(
                    "the router admits {router}-token requests, over this node's {context}"
                ));
            }
        }
    }
}

/// The report as a table, one row per node, then one line per problem.
pub fn render(reports: &[NodeReport]) -> String {
    let mib = |bytes: Option<u64>| bytes.map_or("-".to_string(), |b| format!("{} MiB", b >> 20));
    let number = |n: Option<u64>| n.map_or("-".to_string(), |n| n.to_string());
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<14} {:<8} {:>9} {:>10} {:>14} {:>10} {:>9}  verdict",
        "node", "role", "weights", "KV memory", "pool (tokens)", "context", "headroom"
    );
    for report in reports {
        let headroom = report
            .headroom()
            .map_or("-".to_string(), |h| format!("{h:.2}x"));
        let verdict = if report.ok() { "ok" } else { "FAIL" };
        let _ = writeln!(
            out,
            "{:<14} {:<8} {:>9} {:>10} {:>14} {:>10} {:>9}  {verdict}",
            report.name,
            report.role,
            mib(report.weight_bytes),
            mib(report.kv_bytes),
            number(report.capacity_tokens),
            number(report.context_length),
            headroom,
        );
    }
    for report in reports {
        for problem in &report.problems {
            let _ = writeln!(out, "  {}: {problem}", report.name);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: ModelShape = ModelShape {
        layer_count: 30,
        kv_head_count: 3,
        head_dim: 64,
        context_length_max: 8192,
    };

    const FILE: &str = r#"
        [router]
        context_length = 8192

        [[node]]
        name = "prefill-a"
        role = "prefill"
        kv_memory = "256MiB"

        [[node]]
        name = "decode-b"
        role = "decode"
        kv_tokens = 5322

        [[node]]
        name = "decode-c"
        role = "decode"
        kv_memory_fraction = 0.5
        memory = "2GiB"
        context_length = "auto"
    "#;

    #[test]
    fn one_bad_node_fails_by_name_and_the_others_pass() {
        let reports = evaluate(&parse(FILE).unwrap(), &SHAPE, 100 << 20);
        let verdicts: Vec<(&str, bool)> =
            reports.iter().map(|r| (r.name.as_str(), r.ok())).collect();
        assert_eq!(
            verdicts,
            [("prefill-a", true), ("decode-b", false), ("decode-c", true)]
        );
        // 256 MiB / 368,640 = 728 pages = 11,648 tokens.
        assert_eq!(reports[0].capacity_tokens, Some(11_648));
        assert_eq!(reports[1].capacity_tokens, Some(5_312));
        // (1 GiB - 100 MiB - 128 MiB = 796 MiB) / 368,640 = 2,264 pages = 36,224 tokens.
        assert_eq!(reports[2].capacity_tokens, Some(36_224));
        assert_eq!(reports[2].context_length, Some(8_192));
        let table = render(&reports);
        assert!(table.contains("decode-b: pool holds 5312 tokens, under its context length 8192"));
        assert!(table.contains("0.65x"), "{table}");
    }

    #[test]
    fn cross_node_rules_hold() {
        let file = r#"
            [router]
            context_length = 8192
            [[node]]
            name = "p"
            role = "prefill"
            kv_tokens = 8192
            page_size = 32
            [[node]]
            name = "d"
            role = "decode"
            kv_tokens = 8192
            context_length = 4096
        "#;
        let reports = evaluate(&parse(file).unwrap(), &SHAPE, 0);
        assert!(reports[0]
            .problems
            .iter()
            .any(|p| p.contains("page sizes differ")));
        assert!(reports[1]
            .problems
            .iter()
            .any(|p| p.contains("router admits 8192")));
    }

    #[test]
    fn bad_files_say_why() {
        assert!(parse("").unwrap_err().contains("node"));
        assert!(parse("[[node]]\nname = \"x\"\nrole = \"decode\"\nkv = 3").is_err());
        let reports = evaluate(
            &parse("[[node]]\nname = \"x\"\nrole = \"decode\"").unwrap(),
            &SHAPE,
            0,
        );
        assert!(reports[0].problems[0].contains("exactly one of"));
    }

    #[test]
    fn live_reports_are_checked_the_same_way() {
        let node = LiveNode {
            name: "decode-0".into(),
            role: "decode".into(),
            up: true,
            weight_bytes: Some(1),
            kv_bytes: Some(1),
            capacity_tokens: Some(4096),
            context_length: Some(8192),
            page_size: Some(16),
        };
        let reports = evaluate_live(&[node], None);
        assert!(!reports[0].ok());
        assert!(reports[0].problems.iter().any(|p| p.contains("4096")));
    }
}
